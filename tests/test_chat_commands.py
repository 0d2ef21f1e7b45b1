"""Slash-commands in-process: each one with good and bad arguments, /help, /save, and a fuzz of the parser."""

from __future__ import annotations

import ast
import io
import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from rich.console import Console

from app.engine import Engine
from chat.arguments import parse_processor
from chat.commands import Command, Outcome, build_commands, dispatch
from chat.message_commands import Pending
from chat.repl import ChatRepl
from chat.session import ChatSession, ChatSettings, ModelInfo
from chat.turn import Turn
from sampling.settings import STRATEGIES
from tests.helpers import load_tiny_pair
from utils.logits_processor import GreedyProcessor, NucleusProcessor, TopKNucleusProcessor, TopKProcessor


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_tiny_pair(tmp_path_factory.mktemp("chat_commands"))


@pytest.fixture
def app(pair):
    session = ChatSession(Engine.from_pair(pair), ChatSettings(max_new_tokens=4))
    console = Console(file=io.StringIO(), width=200, color_system=None)
    return ChatRepl(session, console, ModelInfo("target", "drafter", "float32", "cpu"))


def run(app: ChatRepl, line: str) -> str:
    """Dispatch one line; what it printed."""
    app.console.file.seek(0)
    app.console.file.truncate()
    assert dispatch(app, line) is Outcome.CONTINUE
    return app.console.file.getvalue()


def test_help_lists_every_command_with_its_current_value(app):
    run(app, "/gamma 7")
    text = run(app, "/help")
    for name in build_commands():
        assert f"/{name}" in text
    gamma_line = next(line for line in text.splitlines() if line.startswith("/gamma"))
    assert gamma_line.rstrip().endswith("7")
    assert "speculative, autoregressive" in text
    assert "/gamma N" in run(app, "/help gamma")


def test_every_strategy_has_a_toggle(app):
    commands = build_commands()
    assert all(name in commands for name in STRATEGIES)


@pytest.mark.parametrize("line, expected, setting", [
    ("/gamma 6", "gamma (most tokens drafted per round) = 6", lambda s: s.strategy.gamma == 6),
    ("/length 9", "max new tokens = 9", lambda s: s.max_new_tokens == 9),
    ("/seed 42", "seed = 42", lambda s: s.seed == 42),
    ("/seed random", "seed = random", lambda s: s.seed is None),
    ("/processor topk 0.7 20", "processor: topk temperature=0.7 top_k=20",
     lambda s: isinstance(s.processor, TopKProcessor) and s.processor.top_k == 20),
    ("/processor nucleus top_p=0.8", "nucleus temperature=1.0 top_p=0.8",
     lambda s: isinstance(s.processor, NucleusProcessor) and s.processor.top_p == 0.8),
    ("/processor greedy", "processor: greedy", lambda s: isinstance(s.processor, GreedyProcessor)),
    ("/processor", "processor: greedy", lambda s: isinstance(s.processor, GreedyProcessor)),
    ("/chat off", "chat template off", lambda s: not s.chat_template),
    ("/system You are terse.", "system prompt: You are terse.", lambda s: s.system == "You are terse."),
    ("/ngram-store one-level 4", "n-gram store: one-level, n = 4",
     lambda s: (s.strategy.ngram_kind, s.strategy.ngram_n) == ("one-level", 4)),
    ("/filler 3", "filler top-k = 3", lambda s: s.strategy.ngram_filler_top_k == 3),
    ("/ngram-reset off", "persists across prompts", lambda s: not s.strategy.ngram_reset_each_prompt),
    ("/head-lookup off", "the head alone drafts", lambda s: not s.strategy.head_lookup),
    ("/head-lookup on", "prompt lookup where the context holds a copy", lambda s: s.strategy.head_lookup),
    ("/lookup-ngram 4 2", "from 4 down to 2", lambda s: (s.strategy.lookup_max_ngram, s.strategy.lookup_min_ngram)
     == (4, 2)),
    ("/beams 3", "beams = 3", lambda s: s.strategy.num_beams == 3),
    ("/alternatives 2", "draft alternatives = 2", lambda s: s.strategy.draft_alternatives == 2),
    ("/alternatives 0", "draft alternatives = 0 (a chain)", lambda s: s.strategy.draft_alternatives == 0),
    ("/width 9", "verify width = 9: a draft holds at most 8 tokens", lambda s: s.strategy.verify_width == 9),
    ("/cumulative 0.7", "draft cumulative threshold = 0.7: the draft model stops",
     lambda s: s.strategy.draft_cumulative == 0.7),
    ("/cumulative 0", "always drafts gamma tokens", lambda s: s.strategy.draft_cumulative == 0),
    ("/lookahead-params 3 4 2", "W = 3, n-gram size N = 4, candidates G = 2 (up to 15 tokens per forward)",
     lambda s: (s.strategy.lookahead_window, s.strategy.lookahead_ngram, s.strategy.lookahead_candidates)
     == (3, 4, 2)),
    ("/ngram", "ngram on", lambda s: s.strategies == ("speculative", "autoregressive", "ngram")),
    ("/speculative off", "speculative off", lambda s: s.strategies == ("autoregressive",)),
    ("/strategies lookup,autoregressive", "lookup, autoregressive (history from lookup)",
     lambda s: s.strategies == ("lookup", "autoregressive")),
])
def test_good_arguments_change_the_setting(app, line, expected, setting):
    assert expected in run(app, line)
    assert setting(app.session.settings)


@pytest.mark.parametrize("line, expected", [
    ("/gamma", "gamma must be an integer"),
    ("/gamma 0", "gamma must be an integer from 1 to 64, got 0"),
    ("/gamma two", "gamma must be an integer, got 'two'"),
    ("/gamma 3 4", "expected one value"),
    ("/length -1", "max new tokens must be an integer >= 1, got -1"),
    ("/length 5000", "must leave room for a prompt"),
    ("/seed -3", "seed must be an integer from 0 to 9223372036854775807, got -3"),
    ("/processor warm", "unknown processor 'warm'"),
    ("/processor topk 0.7 0", "top_k must be an integer >= 1, got 0"),
    ("/processor nucleus 1.0 1.5", "top_p must be a number in (0, 1], got 1.5"),
    ("/processor multinomial 0", "temperature must be a finite number >= 0.001 (use 0 for greedy)"),
    ("/processor minp 1 nan", "min_p must be a number in"),
    ("/processor topk 1 2 3", "topk takes temperature, top_k; got 3 values"),
    ("/processor topk size=3", "topk has no parameter 'size'"),
    ("/chat maybe", "expected on or off"),
    ("/ngram-store fancy 3", "store kind must be one of basic, one-level"),
    ("/ngram-store basic 1", "n-gram size must be an integer from 2 to 16, got 1"),
    ("/ngram-store basic", "expected a kind and a size"),
    ("/filler -1", "filler top-k must be an integer from 0 to 64, got -1"),
    ("/ngram-reset sometimes", "expected on or off"),
    ("/lookup-ngram 2 3", "min n-gram must be an integer from 1 to 2, got 3"),
    ("/beams 0", "number of beams must be an integer from 1 to 64, got 0"),
    ("/alternatives -1", "draft alternatives must be an integer from 0 to 8, got -1"),
    ("/width 1", "verify width must be an integer from 2 to 64, got 1"),
    ("/cumulative 1", "the cumulative threshold must be a number in [0, 1), got 1.0"),
    ("/cumulative half", "the cumulative threshold must be a number, got 'half'"),
    ("/lookahead-params 2 3", "expected W N G"),
    ("/lookahead-params 2 1 1", "n-gram size N must be an integer from 2 to 8, got 1"),
    ("/lookahead-params 1 3 1", "window W must be an integer from 2 to 16, got 1"),
    ("/beams 1000", "number of beams must be an integer from 1 to 64, got 1000"),
    ("/strategies fast", "unknown strategy 'fast'"),
    ("/reset now", "takes no argument"),
    ("/save", "expected a file name"),
    ("/save /nonexistent-dir/x.md", "cannot write"),
])
def test_bad_arguments_get_one_line_and_the_usage(app, line, expected):
    before = app.session.settings
    text = run(app, line)
    assert expected in text and "usage: /" in text
    assert len(text.strip().splitlines()) == 1
    assert app.session.settings == before


@pytest.mark.parametrize("line, expected", [
    ("/strategies ,", "/strategies: at least one strategy must be enabled  (usage: /strategies [A,B,...])"),
    ("/strategies lookup lookup", "/strategies: a strategy is listed twice  (usage: /strategies [A,B,...])"),
])
def test_a_settings_dataclass_error_is_a_usage_error(app, line, expected):
    """The settings dataclasses check their own values; a command without its own check answers their ValueError in
    one line with its usage."""
    before = app.session.settings
    assert run(app, line).strip() == expected
    assert app.session.settings == before


def test_the_last_strategy_cannot_be_switched_off(app):
    run(app, "/strategies autoregressive")
    assert "at least one strategy must stay enabled" in run(app, "/autoregressive")
    assert app.session.settings.strategies == ("autoregressive",)


def test_drafter_strategies_are_unavailable_without_a_drafter(pair):
    session = ChatSession(Engine(pair.target.model, pair.target.tokenizer, end_ids=pair.end_ids),
                          ChatSettings(strategies=("autoregressive",)))
    app = ChatRepl(session, Console(file=io.StringIO(), width=200), ModelInfo("t", None, "float32", "cpu"))
    assert "needs a drafter" in run(app, "/speculative")
    assert "unavailable (no drafter)" in run(app, "/help")


def test_unknown_commands_suggest_the_closest(app):
    assert "unknown command /gamm; did you mean /gamma?" in run(app, "/gamm 3")
    assert "did you mean /processor?" in run(app, "/procesor greedy")
    assert "/help lists the commands" in run(app, "/zzzzzz")


@pytest.mark.parametrize("space", ["\t", "\u00a0", " \t ", "\u2003"])
def test_a_command_and_its_arguments_split_on_any_whitespace(app, space):
    """Regression: only a plain space split them: "/gamma<TAB>5" answered "unknown command /gamma\t5"."""
    assert "gamma (most tokens drafted per round) = 5" in run(app, f"/gamma{space}5")
    assert "prompt lookup n-grams from 4 down to 2" in run(app, f"/lookup-ngram{space}4{space}2")
    assert "lookup, autoregressive (history from lookup)" in run(app, f"/strategies{space}lookup{space}autoregressive")
    assert app.session.settings.strategy.gamma == 5


def test_a_prompt_that_does_not_fit_is_advised_with_slash_length(app):
    run(app, "/length 1020")
    assert app.ask("Hello! How are you today?") is None
    assert app.console.file.getvalue().rstrip().endswith(": shorten it or lower /length")


def test_quit_and_exit(app):
    assert dispatch(app, "/quit") is Outcome.QUIT
    assert dispatch(app, "/exit") is Outcome.QUIT


def test_toggles_compare_debug_and_reset(app):
    assert "compare off" in run(app, "/compare")
    assert not app.compare and "speculative only (compare off)" in run(app, "/strategies")
    assert "debug on" in run(app, "/debug on") and app.debug
    turn = app.ask("Hello!")
    assert [r.strategy for r in turn.runs] == ["speculative"]  # compare off: the first strategy only
    assert "accepted draft" in app.console.file.getvalue()  # the debug legend
    assert len(app.session.history) == 2
    assert "history cleared" in run(app, "/reset")
    assert app.session.history == [] and len(app.turns) == 1


def test_history_stats_and_save(app, tmp_path):
    run(app, "/system Be brief.")
    assert "(no turns yet)" in run(app, "/history")
    assert "no turns yet" in run(app, "/stats")
    turn = app.ask("Hello!")
    assert [run.strategy for run in turn.runs] == ["speculative", "autoregressive"]
    history = run(app, "/history")
    assert "system Be brief." in history and "user Hello!" in history and "assistant" in history
    stats = run(app, "/stats")
    assert "acceptance by draft position" in stats and "session" in stats
    assert "saved 1 turn to" in run(app, f"/save {tmp_path / 'chat.json'}")
    saved = json.loads((tmp_path / "chat.json").read_text())
    assert saved["turns"][0]["user"] == "Hello!" and saved["turns"][0]["history_from"] == "speculative"
    assert saved["turns"][0]["results"][0]["text"] == turn.answer and saved["system"] == "Be brief."
    run(app, f"/save {tmp_path / 'chat.md'}")
    markdown = (tmp_path / "chat.md").read_text()
    assert "## User\n\nHello!" in markdown and "### speculative (kept in history)" in markdown


def test_save_refuses_an_existing_file_or_a_symlink_unless_forced(app, tmp_path):
    """Regression: /save overwrote an existing file without a word, and wrote through a symlink to its target."""
    app.ask("Hello!")
    mine, precious = tmp_path / "notes.md", tmp_path / "precious.txt"
    mine.write_text("my notes")
    precious.write_text("keep me")
    link, dangling = tmp_path / "link.md", tmp_path / "dangling.md"
    link.symlink_to(precious)
    dangling.symlink_to(tmp_path / "nowhere.md")
    for path in (mine, link, dangling):
        text = run(app, f"/save {path}")
        assert f"{path} exists; /save {path} --force replaces it" in text and len(text.strip().splitlines()) == 1
    assert mine.read_text() == "my notes" and precious.read_text() == "keep me"
    assert not (tmp_path / "nowhere.md").exists()

    assert "saved 1 turn to" in run(app, f"/save {mine} --force")
    assert mine.read_text().startswith("# Chat with target")
    run(app, f"/save {link} --force")  # replaces the link itself, never the file it points to
    assert not link.is_symlink() and link.read_text().startswith("# Chat with target")
    assert precious.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling.md", "link.md", "notes.md", "precious.txt"]


def test_save_counts_turns_in_words(app, tmp_path):
    assert "saved 0 turns to" in run(app, f"/save {tmp_path / 'a.md'}")
    app.ask("Hello!")
    assert "saved 1 turn to" in run(app, f"/save {tmp_path / 'b.md'}")
    app.ask("Again?")
    assert "saved 2 turns to" in run(app, f"/save {tmp_path / 'c.md'}")


MARKUP = ["[/]", "Wrap in [answer]…[/answer]", "[bold red]loud[/bold red]", "/:warning: :smile:"]


@pytest.mark.parametrize("text", MARKUP)
def test_user_text_is_printed_as_typed_never_as_markup_or_emoji(app, tmp_path, text):
    """Regression: user text went through rich's emoji codes (":warning:" became an emoji) in the system prompt, the
    history, warnings and the /save path, and escaping markup by hand was one forgotten call from a MarkupError."""
    assert f"system prompt: {text}" in run(app, f"/system {text}")
    system_line = next(line for line in run(app, "/help").splitlines() if line.startswith("/system"))
    assert system_line.rstrip().endswith(text)
    app.ask(text)
    history = run(app, "/history")
    assert f"system {text}" in history and f"user {text}" in history
    word = text.split()[-1].lower()
    assert f"unknown strategy '{word}'" in run(app, f"/strategies {word}")
    assert f"unknown command /{word.lstrip('/')}" in run(app, f"/{word.lstrip('/')}")
    path = tmp_path / text.replace("/", "_")
    assert f"to {path}" in run(app, f"/save {path}")


def test_parse_processor_defaults_and_keys():
    p = parse_processor("topknucleus")
    assert isinstance(p, TopKNucleusProcessor) and (p.temperature, p.top_k, p.top_p) == (1.0, 50, 0.9)
    p = parse_processor("TOPKNUCLEUS 0.5 top-p=0.7")
    assert (p.temperature, p.top_k, p.top_p) == (0.5, 50, 0.7)


def test_fuzzed_command_lines_never_escape(app, tmp_path, monkeypatch):
    """Random lines built from command names, numbers and junk: every one answers, none raises."""
    monkeypatch.chdir(tmp_path)  # /save with a random name writes here
    rng = random.Random(1234)
    names = list(build_commands()) + ["", "x", "gam", "ngram-", "-", "/"]
    words = ["on", "off", "0", "1", "-1", "2.5", "nan", "inf", "1e9", "99999999999999999999", "top_k=3",
             "temperature=", "=", "basic", "one-level", "greedy", "topk", "minp", "x.json", "\\", "'", '"', "é",
             "\x00", "  ", "ngram,beam", ",,", "speculative", "lookup", "autoregressive"]
    quits = 0
    for _ in range(1500):
        line = "/" + rng.choice(names) + "".join(
            rng.choice([" ", "  ", ",", ""]) + rng.choice(words) for _ in range(rng.randint(0, 4)))
        outcome = dispatch(app, line)
        quits += outcome is Outcome.QUIT
        assert isinstance(outcome, Outcome)
        settings = app.session.settings
        assert settings.strategies and settings.max_new_tokens >= 1 and settings.strategy.gamma >= 1
        assert set(settings.strategies) <= set(STRATEGIES)
    assert quits > 0  # the fuzz did reach /quit (and found the rest)


def test_a_prompt_runs_at_once_while_the_drafter_compiles_and_holds_the_compile_meanwhile(app, monkeypatch):
    """Regression: a prompt sent during the background compile waited for it (tens of seconds to minutes before the
    first token); run beside it, the turn crawled. Now the turn runs at once and the compile waits for it."""
    session = app.session
    release, progress = threading.Event(), [0]

    def step():
        progress[0] += 1

    def compiling(**kwargs):  # stands for torch.compile's Python work: a long run of Python calls
        while not release.is_set():
            step()
        return 1.0

    monkeypatch.setattr(session.drafter, "compile_step", compiling)
    session.engine.compile(drafter=True, target=False, background=True)
    while progress[0] < 1000:
        time.sleep(0.001)
    seen, stream = [], session.stream

    def watched(name, plan):
        for r in stream(name, plan):
            seen.append(progress[0])
            yield r

    monkeypatch.setattr(session, "stream", watched)
    turn = app.ask("Hello!")  # runs now, not after the compile
    assert turn is not None and len(session.history) == 2 and session.compiling
    assert len(seen) > 2 and len(set(seen)) == 1  # the compile made no progress while the turn decoded
    held = progress[0]
    deadline = time.monotonic() + 5
    while progress[0] == held and time.monotonic() < deadline:
        time.sleep(0.001)
    assert progress[0] > held  # and goes on once the turn is over
    release.set()
    session.engine.compiles.wait()
    assert session.compile_status == "compiled (ready after 1 s)"


def chat_imports() -> dict[str, set[str]]:
    """Each chat module's imports of other chat modules, wherever they stand (type-checking blocks included)."""
    graph = {}
    for path in sorted((Path(__file__).resolve().parent.parent / "chat").glob("*.py")):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("chat."):
                found.add(node.module.removeprefix("chat."))
            elif isinstance(node, ast.Import):
                found |= {a.name.removeprefix("chat.") for a in node.names if a.name.startswith("chat.")}
        graph[path.stem] = found
    return graph


def test_no_two_chat_modules_import_each_other():
    """Regression: chat/commands.py imported the REPL module (for its type) while the REPL imported commands.py."""
    graph = chat_imports()
    assert "repl" in graph and "commands" in graph["repl"]

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph.get(start, ()))

    circles = sorted(name for name in graph if reaches(name, name, set()))
    assert circles == []


@dataclass
class BareContext:
    """Just what a command may use: no REPL behind it."""

    session: ChatSession
    console: Console
    info: ModelInfo
    turns: list[Turn] = field(default_factory=list)
    commands: dict[str, Command] = field(default_factory=build_commands)
    compare: bool = True
    debug: bool = False
    pending: Pending = field(default_factory=Pending)
    earlier: list[dict] = field(default_factory=list)


def test_commands_run_on_a_narrow_context_without_the_repl(app, tmp_path):
    ctx = BareContext(app.session, app.console, app.info, turns=[app.ask("Hello!")])
    for line in ("/help", "/compare off", "/debug on", "/stats", "/history", f"/save {tmp_path / 'chat.md'}"):
        run(ctx, line)
    assert not ctx.compare and ctx.debug
    assert "## User\n\nHello!" in (tmp_path / "chat.md").read_text()
