"""One prompt, no REPL: for scripts. In JSON mode the JSON output gets exactly one object and nothing else, whatever
fails: a strategy that failed has an `error` (the others their results), a prompt that does not fit gives every
strategy that error."""

from __future__ import annotations

import json
from typing import TextIO

from rich.console import Console

from chat.render import ConsoleView, comparison_table, turn_rows
from chat.session import ChatSession, ContextOverflow, ModelInfo, Run
from chat.turn import View, run_turn

FAILED_EXIT, INTERRUPTED_EXIT = 1, 130
LENGTH_OPTION = "--max-new-tokens"  # what the advice of a prompt that does not fit names


def result_json(session: ChatSession, run: Run) -> dict:
    stats = run.stats
    identity = run.identity
    return {
        "strategy": run.strategy,
        "lossless": run.lossless and identity in (None, "exact"),  # greedy: only where identity is exact here
        "greedy_identity": identity,  # None: sampled, or a strategy that claims none
        "text": session.decode(session.answer_ids(run)),
        "token_ids": run.token_ids,
        "new_tokens": stats.new_tokens,
        "tokens_per_second": stats.tokens_per_second,
        "acceptance_rate": stats.acceptance_rate if stats.drafted else None,  # None: this strategy drafts nothing
        "mean_tokens_per_round": stats.mean_tokens_per_round,
        "time_to_first_token_s": stats.time_to_first_token,
        "finished": run.finished,  # ended on an end token (False: stopped at the token limit)
        "interrupted": run.interrupted,
        "error": run.error,  # None: it ran
    }


def turn_json(session: ChatSession, info: ModelInfo, runs: list[Run], prompt_tokens: int | None) -> dict:
    invariance = session.invariance
    return {"target": info.target, "drafter": info.drafter, "dtype": info.dtype, "device": info.device,
            "greedy_identity": None if invariance is None else {"exact": invariance.exact, "path": str(invariance.path),
                                                                "reasons": list(invariance.reasons)},
            "prompt_tokens": prompt_tokens, "results": [result_json(session, run) for run in runs]}


def run_oneshot(session: ChatSession, info: ModelInfo, text: str, console: Console, json_out: TextIO | None) -> int:
    """Run `text` through every enabled strategy, each whatever the others did; the answers stream to `console`, or
    with `json_out` come as one JSON object written there. Returns the exit status: 0, FAILED_EXIT if a strategy
    failed, INTERRUPTED_EXIT after Ctrl-C. Raises ValueError if the prompt does not fit the context (after the
    JSON object, where there is one)."""
    as_json = json_out is not None
    view = View() if as_json else ConsoleView(console, session.tokenizer, session.end_ids)
    try:
        turn = run_turn(session, text, view, keep_going=True)
    except ValueError as error:
        message = error.advice(LENGTH_OPTION) if isinstance(error, ContextOverflow) else str(error)
        if as_json:
            runs = [Run(name, error=message) for name in session.settings.strategies]
            _write(json_out, turn_json(session, info, runs, None))
        raise ValueError(message) from None
    if as_json:
        _write(json_out, turn_json(session, info, turn.runs, len(turn.plan.ids)))
    elif len(turn.runs) > 1:
        console.print(comparison_table(turn_rows(turn), session.settings.processor.is_greedy))
    if turn.interrupted:
        return INTERRUPTED_EXIT
    return FAILED_EXIT if turn.failed else 0


def _write(out: TextIO, obj: dict) -> None:
    out.write(json.dumps(obj, ensure_ascii=False) + "\n")
    out.flush()
