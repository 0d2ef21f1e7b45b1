"""One prompt, no REPL: for scripts. In JSON mode the JSON output gets exactly one object and nothing else."""

from __future__ import annotations

import json
from typing import TextIO

from rich.console import Console

from chat.render import ConsoleView, comparison_table, turn_rows
from chat.session import ChatSession, ModelInfo, Run
from chat.turn import Turn, View, run_turn

INTERRUPTED_EXIT = 130


def result_json(session: ChatSession, run: Run) -> dict:
    stats = run.stats
    return {
        "strategy": run.strategy,
        "text": session.decode(session.answer_ids(run)),
        "token_ids": run.token_ids,
        "new_tokens": stats.new_tokens,
        "tokens_per_second": stats.tokens_per_second,
        "acceptance_rate": stats.acceptance_rate if stats.drafted else None,  # None: this strategy drafts nothing
        "mean_tokens_per_round": stats.mean_tokens_per_round,
        "time_to_first_token_s": stats.time_to_first_token,
        "finished": run.finished,  # ended on an end token (False: stopped at the token limit)
        "interrupted": run.interrupted,
    }


def turn_json(session: ChatSession, info: ModelInfo, turn: Turn) -> dict:
    return {"target": info.target, "drafter": info.drafter, "dtype": info.dtype, "device": info.device,
            "prompt_tokens": len(turn.plan.ids), "results": [result_json(session, run) for run in turn.runs]}


def run_oneshot(session: ChatSession, info: ModelInfo, text: str, console: Console, json_out: TextIO | None) -> int:
    """Run `text` through every enabled strategy; the answers stream to `console`, or with `json_out` come as one
    JSON object written there. Raises ValueError if the prompt does not fit the context."""
    as_json = json_out is not None
    view = View() if as_json else ConsoleView(console, session.tokenizer, session.end_ids)
    turn = run_turn(session, text, view)
    if as_json:
        json_out.write(json.dumps(turn_json(session, info, turn), ensure_ascii=False) + "\n")
        json_out.flush()
    elif len(turn.runs) > 1:
        console.print(comparison_table(turn_rows(turn), session.settings.processor.is_greedy))
    return INTERRUPTED_EXIT if turn.interrupted else 0
