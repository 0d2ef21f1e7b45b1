"""Terminal rendering: streamed answers (coloured by origin in debug mode), stats tables, the banner and the
one-line notices (`app.text.Detokenizer` turns the streamed ids into text).

`comparison_table(rows)` and `stats_line(stats)` are plain functions on `Stats`, for any caller that has runs to show.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from app.text import Detokenizer
from app.yardstick import Yardstick
from chat.session import ChatSession, ModelInfo, Plan, Run
from chat.turn import Turn, View
from sampling.base import Round, Stats
from utils.logits_processor import PROCESSORS, LogitsProcessor

DASH = "—"
BASELINE = "autoregressive"
# /debug colours: drafts the target accepted, drafts it rejected (shown struck, not part of the answer), and the
# tokens the target chose itself (the bonus/correction token of a round, or every token of a draft-free strategy).
ACCEPTED_STYLE = "green"
REJECTED_STYLE = "dim red strike"
TARGET_STYLE = "yellow"
# Why a strategy's greedy output need not equal autoregressive's (the comparison says n/a, not NO).
NO_IDENTITY_CLAIM = {"beam": "keeps the likeliest whole sequence, not the likeliest token at each step: it need not "
                             "equal autoregressive by design",
                     "drafter": "is the drafter model alone: another model's answer"}


# ---------------------------------------------------------------------------------------------
# Stats


@dataclass
class ComparisonRow:
    strategy: str
    stats: Stats
    token_ids: list[int] = field(default_factory=list)
    interrupted: bool = False
    failed: bool = False
    lossless: bool = True
    identity: str | None = None  # `ChatSession.greedy_identity`
    claims_identity: bool = True  # `ChatSession.claims_greedy_identity`

    @property
    def complete(self) -> bool:
        return not (self.interrupted or self.failed)


def turn_rows(turn: Turn) -> list[ComparisonRow]:
    return [ComparisonRow(run.strategy, run.stats, run.token_ids, run.interrupted, run.error is not None, run.lossless,
                          run.identity, run.claims_identity) for run in turn.runs]


def _rate(x: float) -> str:
    return f"{x:.1f}" if x > 0 else DASH


def _percent(stats: Stats) -> str:
    return f"{stats.acceptance_rate:.0%}" if stats.drafted else DASH


def _per_round(stats: Stats) -> str:
    # A round that is not one target forward (beam search yields once for many forwards) makes the ratio meaningless.
    if not stats.rounds or stats.rounds != stats.target_forwards:
        return DASH
    return f"{stats.mean_tokens_per_round:.2f}"


def _seconds(stats: Stats) -> str:
    return f"{stats.time_to_first_token:.3f} s" if stats.rounds else DASH


def speedup(stats: Stats, baseline: Stats | None) -> float | None:
    """tokens/s over the baseline's tokens/s; None where either rate is zero or there is no baseline."""
    if baseline is None or baseline.tokens_per_second <= 0 or stats.tokens_per_second <= 0:
        return None
    return stats.tokens_per_second / baseline.tokens_per_second


def identical_to_baseline(row: ComparisonRow, baseline: ComparisonRow | None, greedy: bool) -> bool | None:
    """Whether a greedy output equals the baseline's token for token; None where the question is meaningless (a
    strategy that makes no claim to it by design among them)."""
    if not greedy or baseline is None or row is baseline or not row.complete or not baseline.complete \
            or not row.claims_identity:
        return None
    return row.token_ids == baseline.token_ids


def comparison_table(rows: list[ComparisonRow], greedy: bool = True, baseline: str = BASELINE,
                     title: str | None = None, yardstick: Yardstick | None = None) -> Table:
    """One row per strategy: tokens, tokens/s, speedup over `baseline`, acceptance, tokens/round, time to first
    token, and (greedy only) whether the output is identical to the baseline's. The fastest row is highlighted;
    `yardstick` (llama.cpp's plain speed timed on this machine) is named below with the fastest rate's share of it."""
    base = next((r for r in rows if r.strategy == baseline), None)
    rates = [r.stats.tokens_per_second for r in rows if r.complete]
    fastest = max(rates) if len(rows) > 1 and rates and max(rates) > 0 else None
    caption = f"speedup: tokens/s over {baseline}'s · same: greedy output identical to it"
    if any(row.identity not in (None, "exact") and identical_to_baseline(row, base, greedy) is False for row in rows):
        caption += "\nNO: greedy identity is not exact on this machine (its kernels round a verify otherwise than a "
        caption += "step; /stats says why)"
    unclaimed = [row.strategy for row in rows if greedy and base is not None and row is not base
                 and not row.claims_identity]
    if unclaimed:
        caption += "\nn/a: " + "; ".join(f"{name} {NO_IDENTITY_CLAIM.get(name, 'makes no such claim by design')}"
                                         for name in dict.fromkeys(unclaimed))
    if yardstick is not None and rates and max(rates) > 0:
        caption += "\n" + yardstick.versus(max(rates))
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left", header_style="bold")
    table.add_column("strategy", no_wrap=True)
    for name in ("tokens", "tok/s", "speedup", "accept", "tok/round", "TTFT"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("same", justify="center", no_wrap=True)
    for row in rows:
        up = speedup(row.stats, base.stats if base else None)
        same = identical_to_baseline(row, base, greedy)
        name = row.strategy + (" (failed)" if row.failed else " (interrupted)" if row.interrupted else "")
        name += "" if row.lossless else " (typical: NOT lossless)"
        best = fastest is not None and row.complete and row.stats.tokens_per_second == fastest
        table.add_row(name, str(row.stats.new_tokens), _rate(row.stats.tokens_per_second),
                      f"{up:.2f}×" if up is not None else DASH, _percent(row.stats), _per_round(row.stats),
                      _seconds(row.stats), _same(row, base, greedy, same),
                      style="bold green" if best else None)
    return table


def _same(row: ComparisonRow, base: ComparisonRow | None, greedy: bool, same: bool | None) -> str:
    if greedy and base is not None and row is not base and not row.claims_identity:
        return "n/a"
    return DASH if same is None else ("yes" if same else "NO")


def stats_line(stats: Stats) -> str:
    parts = [f"{stats.new_tokens} tokens", f"{_rate(stats.tokens_per_second)} tok/s"]
    if stats.drafted:
        parts.append(f"accept {_percent(stats)}")
    if _per_round(stats) != DASH:
        parts.append(f"{_per_round(stats)} tok/round")
    parts.append(f"TTFT {_seconds(stats)}")
    return " · ".join(parts)


def detail_table(rows: list[ComparisonRow]) -> Table:
    """/stats: what the comparison table leaves out (forwards, decode speed, acceptance by draft position)."""
    table = Table(header_style="bold", pad_edge=False)
    for name, justify in (("strategy", "left"), ("rounds", "right"), ("target fwd", "right"),
                          ("drafter fwd", "right"), ("drafted", "right"), ("decode tok/s", "right"),
                          ("total", "right"), ("acceptance by draft position", "left")):
        table.add_column(name, justify=justify)
    own = any(row.stats.extra for row in rows)
    if own:
        table.add_column("drafter's own", justify="left")
    for row in rows:
        s = row.stats
        by_position = " ".join(f"{a:.0%}" for a in s.acceptance_by_position) or DASH
        cells = [row.strategy, str(s.rounds), str(s.target_forwards), str(s.drafter_forwards), str(s.drafted),
                 _rate(s.decode_tokens_per_second), f"{s.total_time:.2f} s", by_position]
        table.add_row(*cells, *([own_counts(s.extra)] if own else []))
    return table


def acceptance_histogram(rows: list[ComparisonRow], width: int = 24) -> Text | None:
    """/stats: each drafting strategy's acceptance by draft position as bars (how often the k-th draft of a round
    passed, over the rounds that drafted a k-th); None where no strategy drafted."""
    lines = Text()
    for row in rows:
        s = row.stats
        rates, drafted = s.acceptance_by_position, s.drafted_by_position
        if not s.drafted or rates is None or drafted is None:
            continue
        lines.append(f"{row.strategy}: acceptance by draft position\n", style="bold")
        for position, (rate, count) in enumerate(zip(rates, drafted, strict=True), start=1):
            bar = "█" * round(rate * width)
            lines.append(f"  {position:>2} ")
            lines.append(bar.ljust(width), style=ACCEPTED_STYLE)
            lines.append(f" {rate:>4.0%}  of {count}\n")
    return lines if lines.plain else None


def slower_reason(row: ComparisonRow, baseline: ComparisonRow | None) -> str | None:
    """Where a drafting strategy ran slower than `baseline` (autoregressive) on this prompt, the measured reason in one
    sentence: what a round cost, in autoregressive steps, against the tokens it committed; None where it did not."""
    s = row.stats
    if baseline is None or row is baseline or not s.drafted or not row.complete or not baseline.complete:
        return None
    base = baseline.stats
    if s.tokens_per_second <= 0 or s.tokens_per_second >= base.tokens_per_second or s.rounds < 2:
        return None
    step = 1 / base.decode_tokens_per_second if base.decode_tokens_per_second > 0 else 0.0
    if step <= 0:
        return None
    decode_rounds = s.rounds - 1  # the first round is the prefill's
    round_time = s.decode_time / decode_rounds
    per_round = (s.new_tokens - s.tokens_by_round[0]) / decode_rounds
    cost = round_time / step
    drafter = f", {s.drafter_forwards / s.rounds:.1f} drafter forwards" if s.drafter_forwards else ""
    return (f"{row.strategy} ran slower than {baseline.strategy} here: a round cost {cost:.1f} autoregressive steps "
            f"({round_time * 1e3:.0f} ms against {step * 1e3:.0f} ms; drafting{drafter} and the wider verify took "
            f"{(round_time - step) * 1e3:.0f} ms of it) and committed {per_round:.2f} tokens, so it gained "
            f"{per_round - 1:.2f} tokens a round for {cost - 1:.2f} steps of extra cost")


def own_counts(extra: dict[str, int]) -> str:
    """A drafter's own counts in words: re-tokenizing time (a drafter of another tokenizer), lookahead's pool hits,
    auto's rounds drafted from the session's earlier text."""
    words = {"retokenize_us": lambda us: f"re-tokenizing {us / 1e3:.1f} ms",
             "pool_hits": lambda hits: f"{hits} drafts from the pool",
             "session_rounds": lambda rounds: f"{rounds} rounds from the session's text",
             "session_accepted": lambda drafts: f"{drafts} of their drafts accepted"}
    return " · ".join(words[key](value) if key in words else f"{key} {value}" for key, value in extra.items()) or DASH


def session_totals(turns: list[Turn]) -> dict[str, Stats]:
    """Per strategy: its runs over `turns`, summed."""
    runs: dict[str, list[Stats]] = {}
    for turn in turns:
        for run in turn.runs:
            runs.setdefault(run.strategy, []).append(run.stats)
    return {name: Stats.combine(stats) for name, stats in runs.items()}


def totals_table(turns: list[Turn]) -> Table:
    """/stats: each strategy's turns, tokens, seconds and tokens/s over the session."""
    table = Table(title="session", title_justify="left", header_style="bold", pad_edge=False)
    for name, justify in (("strategy", "left"), ("turns", "right"), ("tokens", "right"), ("seconds", "right"),
                          ("tok/s", "right")):
        table.add_column(name, justify=justify)
    for name, s in session_totals(turns).items():
        table.add_row(name, str(s.runs), str(s.new_tokens), f"{s.total_time:.2f}",
                      f"{s.tokens_per_second:.1f}" if s.total_time else DASH)
    return table


# ---------------------------------------------------------------------------------------------
# Settings and notices


def processor_name(processor: LogitsProcessor) -> str:
    return next((name for name, cls in PROCESSORS.items() if type(processor) is cls), type(processor).__name__)


def describe_processor(processor: LogitsProcessor) -> str:
    if processor.is_greedy:
        return processor_name(processor)
    return " ".join([processor_name(processor)] + [f"{k}={v}" for k, v in vars(processor).items()])


def running(strategies: tuple[str, ...], compare: bool) -> str:
    if not compare:
        return f"{strategies[0]} only (compare off)"
    return f"{', '.join(strategies)} (history from {strategies[0]})"


def describe_heads(heads: dict) -> str:
    """The loaded draft heads: kind, size, and the tokens per step they reached on held-out answers."""
    if not heads:
        return "none (eagle and medusa need one: --head DIR, train_head.py)"
    parts = []
    for kind, head in heads.items():
        held = head.info.get("held_out", {}).get("tree_tokens_per_step")
        parts.append(f"{kind} ({head.size / 1e6:.1f}M parameters" + (f", {held:.2f} tokens/step held out" if held
                                                                      else "") + ")")
    return " · ".join(parts)


def copies(session_match: int) -> str:
    """What auto (and a head with its lookup) copies from besides the draft model."""
    if not session_match:
        return " · auto copies from the context only (/session-match N: its earlier text too)"
    return f" · auto copies from the context, then the session's earlier text where {session_match} tokens match"


def banner(info: ModelInfo, session: ChatSession, compare: bool) -> Panel:
    settings = session.settings
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    rows = {
        "target": info.target + (f" · {info.target_format}" if info.target_format else "")
                  + (f" · forward {session.target_compile_status}" if session.target_compile_status else ""),
        "drafter": (info.drafter or "none") + (f" · {info.drafter_format}" if info.drafter_format else "")
                   + (f" · step {session.compile_status}" if session.compile_status else ""),
        "heads": describe_heads(session.heads),
        "device": info.device + (f" · {info.placement}" if info.placement else ""),
        "drafting": (f"calibrated for this machine: {session.tuning.summary(settings.strategy)} (/stats: why)"
                     if session.tuning else f"not calibrated: gamma {settings.strategy.gamma}, verify width "
                                            f"{settings.strategy.verify_width} (/calibrate)")
                    + copies(settings.strategy.session_min_match),
        "identity": "greedy: " + (session.invariance.summary if session.invariance else "not probed"),
        "strategies": running(settings.strategies, compare),
        "sampling": f"{describe_processor(settings.processor)} · up to {settings.max_new_tokens} new tokens",
        "chat": "template" + (f" · system: {settings.system}" if settings.system else "")
                if session.uses_template else "raw completion (no template)",
    }
    for name, value in rows.items():
        grid.add_row(name, Text(value))  # Text: names and the system prompt are shown as typed, never as markup
    return Panel(grid, title="[bold]specchat[/] · speculative decoding", title_align="left",
                 subtitle="/help for commands · Ctrl-C stops a generation · Ctrl-D quits", subtitle_align="left",
                 border_style="cyan", expand=False)


def interrupt_notice(turn: Turn) -> str:
    first = turn.runs[0]
    if turn.answer is None:
        return "interrupted before the first token: the turn was dropped from the history"
    state = "partial answer" if first.interrupted else "answer"
    return f"interrupted: kept the {state} of {first.strategy} ({len(first.token_ids)} tokens) in the history"


def warn(console: Console, text: str) -> None:
    """One line, however narrow the terminal (the terminal wraps it, not rich)."""
    say(console, text, style="yellow", soft_wrap=True)


def say(console: Console, text: str, style: str = "", **options) -> None:
    """Print `text` as it is: text that can carry user or model words never goes through rich's markup or emoji
    codes ("[/]" would raise, "[answer]" vanish, ":warning:" turn into an emoji)."""
    console.print(Text(text, style=style), **options)


# ---------------------------------------------------------------------------------------------
# Streaming


class StreamPrinter:
    """Prints one answer as its rounds arrive; in debug mode each token is coloured by where it came from."""

    def __init__(self, console: Console, tokenizer, prompt_ids: list[int], end_ids: tuple[int, ...],
                 debug: bool = False):
        self.console, self.tokenizer, self.end_ids, self.debug = console, tokenizer, end_ids, debug
        self.detokenizer = Detokenizer(tokenizer, prompt_ids)

    def round(self, r: Round) -> None:
        tokens = r.tokens[:-1] if r.finished and r.tokens and r.tokens[-1] in self.end_ids else r.tokens
        if not self.debug:
            self._print(self.detokenizer.push(tokens), None)
            return
        accepted = min(r.accepted, len(tokens))
        self._print(self.detokenizer.push(tokens[:accepted]), ACCEPTED_STYLE)
        rejected = r.drafted[r.accepted:]
        if rejected:
            self._print(self.tokenizer.decode(rejected, skip_special_tokens=False), REJECTED_STYLE)
        self._print(self.detokenizer.push(tokens[accepted:]), TARGET_STYLE)

    def finish(self) -> None:
        self._print(self.detokenizer.flush(), TARGET_STYLE if self.debug else None)
        self.console.print()

    def _print(self, text: str, style: str | None) -> None:
        if text:
            self.console.print(Text(text, style=style or ""), end="", soft_wrap=True)


def debug_legend() -> Text:
    return Text.assemble(("accepted draft", ACCEPTED_STYLE), "  ", ("rejected draft", REJECTED_STYLE), "  ",
                         ("target's own token", TARGET_STYLE))


class ConsoleView(View):
    """A turn on the terminal: a header per strategy, the streamed answer, a stats line under it."""

    def __init__(self, console: Console, tokenizer, end_ids: tuple[int, ...], debug: bool = False):
        self.console, self.tokenizer, self.end_ids, self.debug = console, tokenizer, end_ids, debug
        self.printer: StreamPrinter | None = None

    def notice(self, text: str) -> None:
        say(self.console, f"⚠ {text}", style="yellow", soft_wrap=True)

    def begin(self, plan: Plan) -> None:
        say(self.console, f"prompt: {len(plan.ids)} tokens, {plan.reused} of them already in the KV cache",
            style="dim")
        if self.debug:
            self.console.print(debug_legend())

    def start(self, name: str, plan: Plan) -> None:
        self.printer = StreamPrinter(self.console, self.tokenizer, plan.ids, self.end_ids, self.debug)
        self.console.print(Text(name, style="bold cyan"))

    def round(self, r: Round) -> None:
        self.printer.round(r)

    def end(self, run: Run) -> None:
        if self.printer is not None:
            self.printer.finish()
        note = " · interrupted" if run.interrupted else ""
        say(self.console, stats_line(run.stats) + note, style="dim")
        if run.error is not None:
            warn(self.console, f"{run.strategy} failed: {run.error}")
