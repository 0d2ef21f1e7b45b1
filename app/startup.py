"""The pieces of the start that `app.engine.Engine.load` puts together, and what the scripts share around it: the
Ctrl-C guard around the whole run, the model flags as the engine's keywords, the probe and the calibration of this
machine, and the report protocol a script shows the start's lines through. `probe_and_calibrate` imports torch: the
scripts reach it once their flags are checked."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

if TYPE_CHECKING:
    import argparse

    from app.calibration import Tuning
    from app.flags import ModelChoice
    from models.draft_vocabulary import DraftVocabulary
    from models.invariance import Invariance
    from models.loading import LoadedPair
    from sampling.settings import StrategySettings
    from utils.runner import CachedModel

INTERRUPTED_EXIT = 130


def guarded_main(script: str) -> NoReturn:
    """Import `script` and exit with its `main()`; a Ctrl-C while its imports load (seconds, on a cold start) or
    during the run ends it with one line, not a traceback."""
    try:
        code = importlib.import_module(script).main()
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(INTERRUPTED_EXIT)
    # Once the run is over and its output flushed, the process ends without the interpreter's teardown: after a
    # background compile, a native thread's destructor there sometimes aborted a finished chat (exit 134).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def load_options(args: argparse.Namespace, choice: ModelChoice) -> dict[str, Any]:
    """`app.engine.Engine.load`'s keywords for the model flags (`app.flags.add_model_flags`) and the pair they chose."""
    return {"target": choice.target, "drafter": choice.drafter or "none", "heads": args.head,
            "cache_dir": args.cache_dir, "kernels": args.kernels, "device": choice.device, "dtype": args.dtype,
            "target_quantize": choice.target_quantize, "drafter_quantize": choice.drafter_quantize,
            "trust_remote_code": args.trust_remote_code, "verify": args.verify,
            "draft_vocabulary": args.draft_vocabulary,
            "target_placement": choice.target_placement, "drafter_placement": choice.drafter_placement}


def use_kernels(name: str) -> None:
    """--kernels: the project's kernels run `name`'s instruction set from now on (before any weights are packed for
    them); ModelLoadError, one line, where this CPU or build cannot."""
    import kernels
    from utils.errors import ModelLoadError

    try:
        kernels.use(name)
    except RuntimeError as error:
        raise ModelLoadError(f"--kernels {name}: {str(error).splitlines()[0]}") from None


@dataclass(frozen=True)
class Records:
    """Where this machine's probe and timings for one pair are kept: the cache dir, and the key they hold for."""

    cache_dir: Path
    key: dict


def records_for(pair: LoadedPair, cache_dir: Path | None) -> Records:
    """--cache-dir (else the default one) and the loaded pair's key (CPU, torch, models, formats, threads)."""
    from app.calibration import pair_key
    from models.presets import default_cache_dir

    return Records(cache_dir or default_cache_dir(), pair_key(pair))


class Said(Enum):
    PROBLEM = "problem"  # what the user should know: identity not exact, a damaged record replaced
    NEWS = "news"  # found out now: probed or timed (seconds, once per machine)
    KEPT = "kept"  # read back from what an earlier run kept
    WHY = "why"  # the calibration's reasons, one a line


class Report(Protocol):
    """How a script shows the start: a status while something runs, and lines of each kind (it may skip some)."""

    def status(self, text: str) -> contextlib.AbstractContextManager[Any]: ...

    def say(self, text: str, kind: Said) -> None: ...


class Silent:
    def status(self, text: str) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def say(self, text: str, kind: Said) -> None:
        pass


SILENT = Silent()


class PrintReport:
    """Every line on stderr, the statuses too: a benchmark's log keeps them all."""

    def status(self, text: str) -> contextlib.AbstractContextManager[Any]:
        print(text, file=sys.stderr)
        return contextlib.nullcontext()

    def say(self, text: str, kind: Said) -> None:
        prefix = {Said.PROBLEM: "warning: ", Said.WHY: "  "}.get(kind, "")
        print(prefix + text, file=sys.stderr)


@dataclass(frozen=True)
class Prepared:
    """What the start found out: the target's path on which a verify rounds as its steps (`identity`, already
    applied to the target) and, where calibrated, the drafting settings this machine's timings call for."""

    identity: Invariance
    tuning: Tuning | None
    records: Records


def probe_and_calibrate(target: CachedModel, drafter: CachedModel | None, records: Records,
                        settings: StrategySettings, keep: frozenset[str] = frozenset(), *, calibrate: bool = True,
                        again: bool = False, report: Report = SILENT,
                        vocabulary: DraftVocabulary | None = None) -> Prepared:
    """Probe the target's path, then (`calibrate`) time the forwards and choose the drafting settings, but those in
    `keep` (the user's), and the size of the drafter's `vocabulary`; each probed or timed once per machine, models and
    formats (`again`: anew)."""
    from app.calibration import tune
    from models.formats import prefetch

    if again:  # how far ahead the kernels read: a property of the machine's memory, timed at load, now anew
        with report.status("timing how far ahead the kernels read the weights …"):
            prefetch.tune(target.model, records.cache_dir, again=True, announce=False)
    identity, probed = probe_identity(target, records, again, report)
    took = f" (probed in {identity.seconds:.0f} s, kept for this machine)" if probed else ""
    said = Said.NEWS if probed else Said.KEPT
    report.say(f"greedy identity{took}: {identity.summary}", said if identity.exact else Said.PROBLEM)
    if not calibrate:
        return Prepared(identity, None, records)
    with report.status("timing this machine's forwards (once) …"):
        tuning = tune(records.cache_dir, target, drafter, records.key, settings, keep, again=again,
                      vocabulary=vocabulary)
    if tuning.damaged:
        report.say(tuning.damaged, Said.PROBLEM)
    if tuning.measured:
        report.say(f"calibrated in {tuning.calibration.seconds:.0f} s: {tuning.summary()}", Said.NEWS)
    else:
        report.say(f"calibration kept for this machine (timed {tuning.calibration.date}): {tuning.summary()}",
                   Said.KEPT)
    for reason in tuning.choice.reasons:
        report.say(reason, Said.WHY)
    return Prepared(identity, tuning, records)


PROBING = "checking that this machine verifies as it steps (once)"


def probe_identity(target: CachedModel, records: Records, again: bool, report: Report) -> tuple[Invariance, bool]:
    """`app.calibration.probe` with a status for each path it tries. Where it probes anew it first says what that
    costs: seconds on a model in the project's formats, minutes on one placed by a device map (dense weights, unpacked)
    or read back from disk."""
    from app.calibration import probe
    from models.invariance import ATTENTION, FORWARDS_PER_PATH, STEP_ROWS

    with contextlib.ExitStack() as shown:
        def tell(step: str) -> None:
            shown.close()  # the previous step's status ends as the next one begins
            shown.enter_context(report.status(f"{PROBING}: {step} …"))

        if again or not probe_kept(records):
            report.say(f"{PROBING}: up to {len(ATTENTION) * len(STEP_ROWS)} paths of about {FORWARDS_PER_PATH} "
                        "forwards each, until one is exact (minutes on a model placed by a device map); kept for this "
                        "machine", Said.NEWS)
        shown.enter_context(report.status(f"{PROBING} …"))
        return probe(records.cache_dir, target, records.key, again=again, tell=tell)


def probe_kept(records: Records) -> bool:
    """Whether an earlier run kept a probe record for this key (a cheap look: the probe checks it properly)."""
    from utils.files import key_file

    return key_file(records.cache_dir, records.key, "invariance").is_file()

