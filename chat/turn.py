"""One prompt through every enabled strategy: the loop the REPL and the one-shot mode share.

Ctrl-C stops the whole turn. The history keeps what the first enabled strategy committed before the interrupt (its
partial answer, or its whole answer if a later strategy was running); if it committed nothing, the turn is dropped.
"""

from __future__ import annotations

import signal
import threading
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

    @property
    def failed(self) -> bool:
        return any(run.error is not None for run in self.runs)


class CtrlC:
    """Ctrl-C during a turn, remembered as well as raised.

    Python raises KeyboardInterrupt wherever the main thread happens to be, and code there that catches every
    exception loses it: with the drafter's step compiled, the REPL lost about one Ctrl-C in four during an answer,
    somewhere in the compiled step's call path. While a turn runs, SIGINT also sets a flag that the turn checks after
    every round, so Ctrl-C stops it one round later at the latest. Only on the main thread (the one Python delivers
    signals to) and only over Python's default handler (not where SIGINT is ignored or handled by someone else).
    """

    def __init__(self):
        self.pressed, self.previous = False, None

    def __enter__(self) -> CtrlC:
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.pressed = True
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.pressed:
            raise KeyboardInterrupt

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def run_turn(session: ChatSession, text: str, view: View, strategies: tuple[str, ...] | None = None,
             keep_going: bool = False) -> Turn:
    """Run `text` through `strategies` (default: every enabled one) in order and record the first one's answer.
    Raises ValueError (ContextOverflow: the prompt does not fit) before anything changes. A strategy that raises ends
    the turn, or with `keep_going` has its error in `Run.error` and the next one runs (its answer is not recorded)."""
    plan = session.plan(text)
    if plan.dropped_turns:
        kept = " (the system prompt stays)" if session.settings.system else ""
        view.notice(f"the conversation outgrew the context ({session.context_limit} prompt tokens): dropped the "
                    f"{plan.dropped_turns} oldest turn{'s' * (plan.dropped_turns > 1)} at once{kept}, down to "
                    f"{len(plan.ids)} tokens, so the rest stays cached for the turns ahead")
    session.begin(plan)
    view.begin(plan)
    turn = Turn(text, plan)
    with CtrlC() as ctrl_c, session.compile_paused():
        try:
            for name in strategies or session.settings.strategies:
                run = Run(name, lossless=session.lossless(name), identity=session.greedy_identity(name),
                          claims_identity=session.claims_greedy_identity(name))
                turn.runs.append(run)
                view.start(name, plan)
                try:
                    for r in session.stream(name, plan):
                        run.rounds.append(r)
                        view.round(r)
                        ctrl_c.check()
                except Exception as error:  # noqa: BLE001 (keep_going: any failure is this strategy's result)
                    if not keep_going:
                        raise
                    reason = next(iter(str(error).strip().splitlines()), "")
                    run.error = f"{type(error).__name__}: {reason}" if reason else type(error).__name__
                view.end(run)
        except KeyboardInterrupt:
            if turn.runs:
                turn.runs[-1].interrupted = True
                view.end(turn.runs[-1])
    first = turn.runs[0] if turn.runs else None
    if first is not None and first.rounds and first.error is None:
        answer = session.answer_ids(first)
        turn.answer = session.decode(answer)
        session.record(text, turn.answer, plan.ids + answer)
    return turn
