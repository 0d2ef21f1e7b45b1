"""The REPL's messages on a tiny pair: a paste through the line editor is one turn; /regen, /read, /edit and /load,
each with the bad input that must leave the chat as it was."""

from __future__ import annotations

import io
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput
from rich.console import Console

from app.engine import Engine
from chat.commands import Outcome
from chat.repl import ChatRepl
from chat.session import ChatSession, ChatSettings, Message, ModelInfo
from tests.helpers import load_tiny_pair

SNIPPET = "Fix this function:\ndef add(a, b):\n    return a - b"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_tiny_pair(tmp_path_factory.mktemp("chat_messages"))


def make_repl(pair, **settings) -> ChatRepl:
    session = ChatSession(Engine.from_pair(pair), ChatSettings(**{"max_new_tokens": 4, **settings}))
    return ChatRepl(session, Console(file=io.StringIO(), width=300, color_system=None),
                    ModelInfo("target", "drafter", "float32", "cpu"))


@pytest.fixture
def repl(pair):
    return make_repl(pair)


def said(repl: ChatRepl, line: str) -> str:
    """Handle one line as the REPL does; what it printed."""
    repl.console.file.seek(0)
    repl.console.file.truncate()
    assert repl.handle(line) is Outcome.CONTINUE
    return repl.console.file.getvalue()


def test_a_pasted_block_is_one_turn_with_one_answer(repl):
    with create_pipe_input() as pipe:
        reader = repl.terminal_reader(input=pipe, output=DummyOutput())
        pipe.send_text("\x1b[200~" + SNIPPET.replace("\n", "\r") + "\x1b[201~\r/quit\r")
        assert repl.run(reader) == 0
    assert [turn.user for turn in repl.turns] == [SNIPPET]
    assert [m.role for m in repl.session.history] == ["user", "assistant"]


def test_a_pasted_block_starting_with_a_slash_is_sent_not_run(repl):
    with create_pipe_input() as pipe:
        reader = repl.terminal_reader(input=pipe, output=DummyOutput())
        pipe.send_text("\x1b[200~/etc/hosts has\rtwo lines\x1b[201~\r/quit\r")
        repl.run(reader)
    assert [turn.user for turn in repl.turns] == ["/etc/hosts has\ntwo lines"]
    assert "unknown command" not in repl.console.file.getvalue()


def test_regen_replaces_the_last_answer_from_the_cropped_cache(repl):
    said(repl, "Hello there")
    first = repl.turns[-1]
    repl.session.update(strategies=("autoregressive",), max_new_tokens=6)
    out = said(repl, "/regen")
    again = repl.turns[-1]
    assert again is not first and again.user == "Hello there" and [r.strategy for r in again.runs] == ["autoregressive"]
    assert again.plan.ids == first.plan.ids and again.plan.reused >= len(again.plan.ids) - 1  # no prefill again
    assert repl.session.history == [Message("user", "Hello there"), Message("assistant", again.answer)]
    assert "prompt:" in out


def test_regen_with_nothing_to_regenerate_says_so(repl):
    assert "/regen: nothing to regenerate yet" in said(repl, "/regen")
    assert "takes no argument" in said(repl, "/regen now")


def test_a_failed_regen_keeps_the_previous_answer(repl):
    said(repl, "Hello there")
    history = list(repl.session.history)
    repl.session.update(max_new_tokens=repl.session.context_length)  # no room left for the prompt
    out = said(repl, "/regen")
    assert "lower /length" in out and "the previous answer stays" in out
    assert repl.session.history == history


def test_read_holds_a_file_for_the_next_message(repl, tmp_path):
    code = tmp_path / "add.py"
    code.write_text("def add(a, b):\n    return a - b\n")
    out = said(repl, f"/read {code}")
    assert "(2 lines, 32 characters)" in out and "starts your next message" in out
    assert repl._prompt() == f"you [{code}] ›"
    said(repl, "What is wrong here?")
    assert repl.turns[-1].user == "def add(a, b):\n    return a - b\n\n\nWhat is wrong here?"
    assert not repl.pending and repl._prompt() == "you ›"


def test_read_then_enter_alone_sends_the_file(repl, tmp_path):
    (tmp_path / "q.txt").write_text("Say hi")
    said(repl, f"/read {tmp_path / 'q.txt'}")
    said(repl, "")
    assert repl.turns[-1].user == "Say hi"


@pytest.mark.parametrize("content, expected", [
    (None, "no file"), (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "is not a text file"), (b"  \n", "is empty"),
    (b"x" * (300 * 1024), "/read takes text files up to 256 kB"),
])
def test_read_refuses_a_missing_binary_empty_or_huge_file_in_one_line(repl, tmp_path, content, expected):
    path = tmp_path / "file"
    if content is not None:
        path.write_bytes(content)
    out = said(repl, f"/read {path}")
    assert expected in out and len(out.strip().splitlines()) == 1 and not repl.pending
    assert "is a directory" in said(repl, f"/read {tmp_path}")


def test_read_replaces_invalid_utf8_and_says_so(repl, tmp_path):
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9 au lait, a long enough line of text")
    out = said(repl, f"/read {tmp_path / 'latin.txt'}")
    assert "1 invalid UTF-8 byte" in out and repl.pending.before("") == "caf\ufffd au lait, a long enough line of text"


def test_ctrl_c_at_the_prompt_drops_what_read_held(repl, tmp_path):
    (tmp_path / "q.txt").write_text("Say hi")
    said(repl, f"/read {tmp_path / 'q.txt'}")

    class CtrlC:
        def read(self, prompt):
            raise KeyboardInterrupt

    assert repl.read(CtrlC()) == "" and not repl.pending
    assert "dropped the text read from" in repl.console.file.getvalue()


def editor_script(tmp_path: Path, text: str, status: int = 0) -> str:
    script = tmp_path / "editor.py"
    script.write_text(f"import sys\nopen(sys.argv[1], 'w').write({text!r})\nsys.exit({status})\n")
    return f"{sys.executable} {script}"


def test_edit_sends_what_was_written_in_the_editor(repl, tmp_path, monkeypatch):
    monkeypatch.delenv("VISUAL", raising=False)
    monkeypatch.setenv("EDITOR", editor_script(tmp_path, "/usr/bin is\nwritten here\n"))
    said(repl, "/edit")
    assert repl.turns[-1].user == "/usr/bin is\nwritten here"  # a message, though it starts with a slash


def test_edit_with_nothing_written_or_a_failing_editor_loses_nothing(repl, tmp_path, monkeypatch):
    monkeypatch.delenv("VISUAL", raising=False)
    monkeypatch.setenv("EDITOR", editor_script(tmp_path, "\n"))
    assert "nothing written: nothing sent" in said(repl, "/edit") and not repl.turns
    monkeypatch.setenv("EDITOR", editor_script(tmp_path, "half a thought", status=1))
    out = said(repl, "/edit")
    assert "exited with status 1: its text is held" in out and repl.pending.before("") == "half a thought"
    monkeypatch.setenv("EDITOR", str(tmp_path / "no-such-editor"))
    assert "cannot run the editor" in said(repl, "/edit")


def test_save_then_load_resumes_history_system_settings_and_strategies(pair, repl, tmp_path):
    said(repl, "/system Be brief.")
    said(repl, "/gamma 3")
    said(repl, "/strategies autoregressive,speculative")
    said(repl, "/compare off")
    said(repl, "/processor topk 0.7 20")
    said(repl, "/seed 5")
    said(repl, "Hello there")
    said(repl, "And again")
    said(repl, f"/save {tmp_path / 'chat.json'}")
    fresh = make_repl(pair)
    out = said(fresh, f"/load {tmp_path / 'chat.json'}")
    assert "resumed" in out and "2 exchanges" in out
    assert fresh.session.history == repl.session.history
    assert replace(fresh.session.settings, processor=None) == replace(repl.session.settings, processor=None)
    assert vars(fresh.session.settings.processor) == {"temperature": 0.7, "top_k": 20}
    assert fresh.session.settings.system == "Be brief." and fresh.session.settings.strategy.gamma == 3
    assert not fresh.compare
    said(fresh, "/regen")  # the last message of the resumed chat
    assert fresh.turns[-1].user == "And again" and len(fresh.session.history) == 4
    said(fresh, f"/save {tmp_path / 'again.json'}")
    assert [t["user"] for t in json.loads((tmp_path / "again.json").read_text())["turns"]] == \
        ["Hello there", "And again", "And again"]


def test_load_without_a_drafter_leaves_out_the_strategies_that_need_one(pair, repl, tmp_path):
    said(repl, "Hello there")
    said(repl, f"/save {tmp_path / 'chat.json'}")
    session = ChatSession(Engine(pair.target.model, pair.target.tokenizer, end_ids=pair.end_ids),
                          ChatSettings(strategies=("autoregressive",), max_new_tokens=4))
    bare = ChatRepl(session, Console(file=io.StringIO(), width=300, color_system=None),
                    ModelInfo("other", None, "float32", "cpu"))
    out = said(bare, f"/load {tmp_path / 'chat.json'}")
    assert "left out speculative" in out and "saved with target; this chat runs other" in out
    assert session.settings.strategies == ("autoregressive",) and len(session.history) == 2


def damaged(record: dict) -> list[tuple[str, str]]:
    """(file text, what the one line says) for ways a saved chat goes wrong."""
    wrong_role = {**record, "history": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]}
    return [
        (json.dumps(record)[:-20], "is not JSON"),
        (json.dumps({"hello": "world"}), "is not a chat saved with /save FILE.json"),
        (json.dumps(wrong_role), "history is damaged at message 1"),
        (json.dumps({**record, "settings": {**record["settings"], "max_new_tokens": 0}}), "settings are invalid"),
        (json.dumps({**record, "settings": {**record["settings"], "strategy": {"gamma": "x"}}}),
         "settings are invalid"),
        (json.dumps({**record, "settings": {**record["settings"], "strategies": ["warp"]}}), "unknown strategy"),
        (json.dumps({**record, "history": "oops"}), "'history' is missing or damaged"),
        ("\x89PNG\x00", "is not JSON"),
    ]


def test_a_damaged_or_foreign_file_changes_nothing(repl, tmp_path):
    said(repl, "Hello there")
    said(repl, f"/save {tmp_path / 'chat.json'}")
    record = json.loads((tmp_path / "chat.json").read_text())
    said(repl, "/system Stay.")
    said(repl, "Second")
    before = (list(repl.session.history), repl.session.settings, repl.compare, list(repl.turns))
    for text, expected in damaged(record) + [("", "no file")]:
        path = tmp_path / "bad.json"
        path.unlink(missing_ok=True)
        if expected != "no file":
            path.write_text(text, errors="surrogateescape")
        out = said(repl, f"/load {path}")
        assert expected in out and "/load" in out and len(out.strip().splitlines()) == 1, out
        assert (list(repl.session.history), repl.session.settings, repl.compare, list(repl.turns)) == before
        assert repl.session.settings.processor is before[1].processor
    assert "is a directory" in said(repl, f"/load {tmp_path}")


def test_every_answer_ends_with_one_stats_line_even_with_compare_off(repl):
    said(repl, "/compare off")
    out = said(repl, "Hello there")
    lines = [line for line in out.splitlines() if "tok/s" in line]
    assert len(lines) == 1 and "tokens" in lines[0] and "accept" in lines[0] and "tok/round" in lines[0]
    stats = said(repl, "/stats")
    assert "speculative: acceptance by draft position" in stats and "█" in stats or "  0%  of" in stats
