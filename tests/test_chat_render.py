"""Incremental detokenisation and the comparison table."""

from __future__ import annotations

import pytest
from rich.console import Console

from app.engine import Engine
from chat.render import (
    ComparisonRow,
    ConsoleView,
    Detokenizer,
    acceptance_histogram,
    banner,
    comparison_table,
    session_totals,
    slower_reason,
    speedup,
    stats_line,
    totals_table,
    warn,
)
from chat.session import ChatSession, ChatSettings, ModelInfo, Plan, Run
from chat.turn import Turn
from sampling.base import Round, Stats
from tests.helpers import build_tokenizer, load_tiny_pair


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every decode call."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, ids, **kwargs):
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def stream(detokenizer: Detokenizer, ids: list[int], step: int = 1) -> list[str]:
    pieces = [detokenizer.push(ids[i:i + step]) for i in range(0, len(ids), step)]
    return pieces + [detokenizer.flush()]


@pytest.mark.parametrize("step", [1, 3])
def test_streamed_text_equals_the_whole_decode(tokenizer, step):
    text = "Hello! How are you today? Zwölf Ärzte — naïve café, 東京 🚀 done."
    ids = tokenizer(text)["input_ids"]
    pieces = stream(Detokenizer(tokenizer), ids, step)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_a_character_split_across_tokens_is_held_back_until_complete(tokenizer):
    ids = tokenizer("🚀")["input_ids"]  # byte-level BPE: four bytes, none merged by this corpus
    assert len(ids) > 1 and "\ufffd" in tokenizer.decode(ids[:1])
    detokenizer = Detokenizer(tokenizer)
    assert [detokenizer.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detokenizer.push(ids[-1:]) == "🚀"


def test_decoding_looks_only_at_a_short_window(tokenizer):
    counting = CountingTokenizer(tokenizer)
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 20)["input_ids"]
    detokenizer = Detokenizer(counting, context_ids=[1, 2, 3, 4, 5, 6])
    "".join(stream(detokenizer, ids))
    assert len(ids) > 100 and max(counting.lengths) <= 6


def test_context_tokens_are_not_shown(tokenizer):
    prompt = tokenizer("Hello! How are")["input_ids"]
    answer = tokenizer(" you today?")["input_ids"]
    assert "".join(stream(Detokenizer(tokenizer, prompt), answer)) == " you today?"


def test_text_before_a_split_character_is_not_held_back(tokenizer):
    ids = tokenizer("ok 🚀 go")["input_ids"]
    rocket = [i for i, t in enumerate(ids) if "\ufffd" in tokenizer.decode(ids[: i + 1])]
    detokenizer = Detokenizer(tokenizer)
    assert detokenizer.push(ids[: rocket[0] + 1]) == "ok "
    assert detokenizer.push(ids[rocket[0] + 1:]) == "🚀 go"


def test_an_incomplete_character_at_the_end_is_flushed(tokenizer):
    ids = tokenizer("ok 🚀")["input_ids"]
    detokenizer = Detokenizer(tokenizer)
    shown = detokenizer.push(ids[:-1])
    assert shown == "ok " and detokenizer.flush() == "\ufffd"


def stats_of(rounds: list[Round]) -> Stats:
    stats = Stats()
    for r in rounds:
        stats.add(r)
    return stats


def render(table) -> str:
    console = Console(width=160, record=True, color_system=None, file=open("/dev/null", "w"))
    console.print(table)
    return console.export_text()


def test_comparison_table_columns_speedup_and_identity():
    base = stats_of([Round([1], elapsed=0.1), Round([2], elapsed=0.2), Round([3], elapsed=0.4)])
    fast = stats_of([Round([1, 2, 3], drafted=[1, 2, 9], accepted=2, elapsed=0.1)])
    rows = [ComparisonRow("speculative", fast, [1, 2, 3]), ComparisonRow("autoregressive", base, [1, 2, 3]),
            ComparisonRow("ngram", fast, [1, 2, 4])]
    text = render(comparison_table(rows, greedy=True))
    spec = next(line for line in text.splitlines() if "speculative" in line)
    assert "30.0" in spec and "4.00×" in spec and "67%" in spec and "3.00" in spec and "yes" in spec
    ar = next(line for line in text.splitlines() if "autoregressive" in line)
    assert "7.5" in ar and "1.00×" in ar and "—" in ar
    assert "NO" in next(line for line in text.splitlines() if "ngram" in line)
    assert speedup(fast, base) == pytest.approx(4.0)


def test_comparison_table_is_zero_safe():
    empty = Stats()
    rows = [ComparisonRow("speculative", empty), ComparisonRow("beam", stats_of([Round([5, 6], target_forwards=4)]))]
    text = render(comparison_table(rows, greedy=False))
    assert "speculative" in text and "beam" in text
    assert speedup(empty, None) is None and speedup(empty, empty) is None
    beam = next(line for line in text.splitlines() if "beam" in line)
    assert beam.count("—") >= 4  # tok/s (zero time), speedup, acceptance, tokens/round (one round, four forwards)
    assert stats_line(empty).startswith("0 tokens")


def test_the_fastest_row_is_highlighted():
    slow = stats_of([Round([1], elapsed=1.0)])
    fast = stats_of([Round([1, 2], elapsed=0.5)])
    table = comparison_table([ComparisonRow("autoregressive", slow), ComparisonRow("lookup", fast)])
    assert [row.style for row in table.rows] == [None, "bold green"]


def test_session_totals_are_ratios_of_sums():
    """/stats' session row sums every run of a strategy (Stats.combine): tokens/s is all tokens over all seconds."""
    turns = [Turn("a", Plan([1]), [Run("lookup", [Round([1, 2, 3], elapsed=1.0)])]),
             Turn("b", Plan([1]), [Run("lookup", [Round([4], elapsed=0.5), Round([5], elapsed=1.0)])])]
    totals = session_totals(turns)["lookup"]
    assert (totals.runs, totals.new_tokens, totals.total_time, totals.tokens_per_second) == (2, 5, 2.0, 2.5)
    assert "2.5" in printed(totals_table(turns))


MARKUP = ["[/]", "Wrap in [answer]…[/answer]", "[bold red]loud[/bold red]", "/:warning: :smile:"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_tiny_pair(tmp_path_factory.mktemp("chat_render"))


def printed(*renderables) -> str:
    console = Console(width=200, record=True, color_system=None, file=open("/dev/null", "w"))
    for renderable in renderables:
        console.print(renderable)
    return console.export_text()


@pytest.mark.parametrize("text", MARKUP)
def test_the_banner_shows_user_text_as_typed(pair, text):
    """Regression: `--system "[/]"` crashed the banner with a MarkupError, "[answer]" vanished from it, and emoji
    codes were expanded."""
    session = ChatSession(Engine(pair.target.model, pair.target.tokenizer, end_ids=pair.end_ids),
                          ChatSettings(strategies=("autoregressive",), system=text))
    shown = printed(banner(ModelInfo(f"target {text}", f"drafter {text}", "float32", "cpu"), session, True))
    assert f"system: {text}" in shown and f"target {text}" in shown and f"drafter {text}" in shown


@pytest.mark.parametrize("text", MARKUP)
def test_notices_and_warnings_show_their_text_as_typed(tokenizer, text):
    console = Console(width=200, record=True, color_system=None, file=open("/dev/null", "w"))
    ConsoleView(console, tokenizer, ()).notice(text)
    warn(console, text)
    assert console.export_text() == f"⚠ {text}\n{text}\n"


def test_a_strategy_that_claims_no_greedy_identity_says_n_a_not_no():
    base = stats_of([Round([1], elapsed=0.1), Round([2], elapsed=0.2)])
    beam = stats_of([Round([1, 3], target_forwards=4, elapsed=0.3)])
    rows = [ComparisonRow("autoregressive", base, [1, 2]), ComparisonRow("beam", beam, [1, 3], claims_identity=False),
            ComparisonRow("lookup", base, [1, 3])]
    table = comparison_table(rows, greedy=True)
    text = render(table)
    assert "n/a" in next(line for line in text.splitlines() if "│ beam" in line or line.startswith("│beam"))
    assert "NO" in next(line for line in text.splitlines() if "lookup" in line)
    assert "n/a: beam keeps the likeliest whole sequence" in str(table.caption)
    sampled = comparison_table(rows, greedy=False)
    assert "n/a" not in render(sampled)


def test_stats_histogram_and_the_measured_reason_a_drafter_was_slower():
    ar = stats_of([Round([1], elapsed=0.1)] + [Round([i], elapsed=0.05 + 0.05 * i) for i in range(2, 12)])
    slow = stats_of([Round([1], elapsed=0.1)] + [Round([2, 3], drafted=[2, 9, 9], accepted=1, drafter_forwards=3,
                                                         elapsed=0.1 + 0.2 * i) for i in range(1, 6)])
    rows = [ComparisonRow("autoregressive", ar), ComparisonRow("speculative", slow)]
    histogram = acceptance_histogram(rows).plain
    assert "speculative: acceptance by draft position" in histogram and "autoregressive" not in histogram
    assert " 1 " in histogram and "100%  of 5" in histogram and "0%  of 5" in histogram
    reason = slower_reason(rows[1], rows[0])
    # a round: 200 ms against a 50 ms step = 4.0 steps, for 2 tokens: 1 token gained for 3 steps of extra cost
    assert reason.startswith("speculative ran slower than autoregressive here: a round cost 4.0 autoregressive steps")
    assert "200 ms against 50 ms; drafting, 2.5 drafter forwards and the wider verify took 150 ms" in reason
    assert "committed 2.00 tokens, so it gained 1.00 tokens a round for 3.00 steps of extra cost" in reason
    assert slower_reason(rows[0], rows[0]) is None and slower_reason(ComparisonRow("lookup", ar), rows[0]) is None
