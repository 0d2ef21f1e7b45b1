"""One prompt through every enabled strategy: the loop the REPL and the one-shot mode share.

Ctrl-C stops the whole turn. The history keeps what the first enabled strategy committed before the interrupt (its
partial answer, or its whole answer if a later strategy was running); if it committed nothing, the turn is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chat.session import ChatSession, Plan, Run
from sampling.base import Round


class View:
    """What a turn reports as it runs; the default shows nothing (the one-shot JSON mode)."""

    def notice(self, text: str) -> None:
        pass

    def begin(self, plan: Plan) -> None:
        pass

    def start(self, name: str, plan: Plan) -> None:
        pass

    def round(self, r: Round) -> None:
        pass

    def end(self, run: Run) -> None:
        pass


@dataclass
class Turn:
    user: str
    plan: Plan
    runs: list[Run] = field(default_factory=list)
    answer: str | None = None  # what went into the history (None: nothing did)

    @property
    def interrupted(self) -> bool:
        return any(run.interrupted for run in self.runs)


def run_turn(session: ChatSession, text: str, view: View, strategies: tuple[str, ...] | None = None) -> Turn:
    """Run `text` through `strategies` (default: every enabled one) in order and record the first one's answer.
    Raises ValueError (the prompt does not fit) before anything changes."""
    plan = session.plan(text)
    if plan.dropped_turns:
        view.notice(f"the conversation outgrew the context ({session.context_limit} prompt tokens): dropped the "
                    f"{plan.dropped_turns} oldest turn{'s' * (plan.dropped_turns > 1)}")
    if session.compiling:
        view.notice("the drafter's step is still compiling in the background: this turn shares the CPU with it, so its "
                    "timings and speedups do not compare")
    session.begin(plan)
    view.begin(plan)
    turn = Turn(text, plan)
    try:
        for name in strategies or session.settings.strategies:
            run = Run(name)
            turn.runs.append(run)
            view.start(name, plan)
            for r in session.stream(name, plan):
                run.rounds.append(r)
                view.round(r)
            view.end(run)
    except KeyboardInterrupt:
        if turn.runs:
            turn.runs[-1].interrupted = True
            view.end(turn.runs[-1])
    first = turn.runs[0] if turn.runs else None
    if first is not None and first.rounds:
        turn.answer = session.decode(session.answer_ids(first))
        session.record(text, turn.answer)
    return turn
