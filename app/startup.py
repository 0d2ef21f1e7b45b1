"""What infer.py and bench.py do alike: the Ctrl-C guard around the whole run, loading the pair with its heads, and
the rule for compiling the drafter's step. `load` imports torch: the scripts call it once their flags are checked."""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    import argparse

    from app.flags import ModelChoice
    from models.loading import LoadedPair
    from sampling.heads import DraftHead

INTERRUPTED_EXIT = 130


def guarded_main(script: str) -> NoReturn:
    """Import `script` and exit with its `main()`; a Ctrl-C while its imports load (seconds, on a cold start) or
    during the run ends it with one line, not a traceback."""
    try:
        sys.exit(importlib.import_module(script).main())
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(INTERRUPTED_EXIT)


def load(args: argparse.Namespace, choice: ModelChoice, progress: bool) -> tuple[LoadedPair, dict[str, DraftHead]]:
    """The pair the model flags chose, and the draft heads --head names (ModelLoadError, one line, for a wrong one)."""
    from models.loading import load_pair
    from sampling.heads import load_heads

    pair = load_pair(choice.target, choice.drafter, device=choice.device, dtype=args.dtype,
                     target_quantize=choice.target_quantize, drafter_quantize=choice.drafter_quantize,
                     trust_remote_code=args.trust_remote_code, cache_dir=args.cache_dir, verify=args.verify,
                     progress=progress)
    return pair, load_heads(args.head, pair.target.name, pair.target.model)


def compiles_by_default(pair: LoadedPair) -> bool:
    """The drafter's one-token step compiles by default on a CPU, where Python and dispatch are a large share of
    it, unless its weights are oneDNN-prepacked (torch.compile cannot lower them)."""
    from models.formats.prepack import is_prepacked

    drafter = pair.drafter
    return (drafter is not None and next(drafter.model.parameters()).device.type == "cpu"
            and not is_prepacked(drafter.model))
