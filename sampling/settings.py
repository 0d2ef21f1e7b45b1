"""Strategy names and the settings every strategy is built from: plain data, importable without torch.

`StrategySettings` is where each setting's bounds live: the command lines and the slash-commands build one and
translate its `SettingError` into their own words. docs/defaults.md has the measurements behind the defaults.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from utils.checks import SettingError, choice, integer, number, switch

STRATEGIES = ("autoregressive", "speculative", "auto", "drafter", "ngram", "lookup", "lookahead", "beam", "eagle",
              "medusa")
NEEDS_DRAFTER = ("speculative", "auto", "drafter")
NEEDS_HEAD = ("eagle", "medusa")  # a trained head of that kind (sampling/heads/networks.py)
# The drafting settings the per-machine calibration chooses (app/calibration.py), where the user did not.
CALIBRATED = ("gamma", "verify_width", "draft_alternatives", "draft_cumulative")
STORE_KINDS = ("basic", "one-level")  # the n-gram store's kinds (sampling/drafters/ngram.py)


@dataclass(frozen=True)
class StrategySettings:
    # The most tokens a round drafts; the draft model stops earlier by draft_cumulative, so a high cap costs little.
    # Per strategy (sampling/registry.py): speculative, ngram and lookup draft at most gamma; auto (and eagle and
    # medusa with head_lookup) at most max(copy_gamma, gamma), the draft model (the head) gamma; lookahead
    # lookahead_ngram - 1, whatever gamma is.
    gamma: int = 12
    # The draft model: stop drafting below this confidence (0: never); HF's grow/shrink draft-length schedule.
    draft_confidence: float = 0.0
    draft_adaptive: bool = False
    # The draft model: stop once the product of its probabilities of its tokens falls below this (0: always gamma
    # tokens); near the drafter's cost times the tokens a target step commits, where one more draft stops paying.
    draft_cumulative: float = 0.2
    # Greedy: the draft model's next-best tokens at each depth verified beside its chain (a token tree; 0: a chain);
    # a 16-bit target verifies them at almost no cost (in float32 on a CPU a wider verify costs more: use 0 there).
    draft_alternatives: int = 4
    # The most tokens one verify forward takes (the last committed token and the draft), the least likely alternatives
    # dropped first: the widest forward that costs about what a one-token forward does.
    verify_width: int = 14
    # auto: prompt lookup drafts up to copy_gamma tokens where it matches at least auto_min_match tokens of context;
    # the draft model (gamma tokens) elsewhere.
    copy_gamma: int = 8
    auto_min_match: int = 2
    ngram_n: int = 3
    ngram_kind: str = "basic"
    ngram_filler_top_k: int = 0
    ngram_reset_each_prompt: bool = True
    lookup_max_ngram: int = 3
    lookup_min_ngram: int = 1
    # Lookahead: window W, n-gram size N, candidates G; wider windows and more candidates do not pay for their
    # tokens on a CPU, where a wider forward costs more.
    lookahead_window: int = 2
    lookahead_ngram: int = 3
    lookahead_candidates: int = 1
    # eagle and medusa: each node's likeliest children kept (and, for eagle, the nodes a depth expands); the tree
    # has at most verify_width - 1 tokens and gamma levels.
    head_branch: int = 4
    # eagle stops deepening once no node at the frontier is likelier than this: the draft model's rule (P < c * r)
    # at a head step's cost, a few hundredths of a target step.
    head_cumulative: float = 0.1
    # eagle and medusa: prompt lookup drafts where the context holds a copy (auto's rule: auto_min_match tokens
    # matched, up to copy_gamma drafted), the head elsewhere; heads draft copied text poorly.
    head_lookup: bool = True
    # auto (and eagle and medusa with head_lookup): where the context holds no copy, the session's earlier prompts and
    # answers draft the round where the context's last session_min_match tokens or more (4 to 16) occurred there
    # (0: never); shorter matches guess the next token less often than the draft model does (docs/options.md).
    session_min_match: int = 8
    # Sampling with eagle or medusa: Medusa's typical acceptance instead of the lossless rule. NOT lossless: the
    # output no longer follows the target's distribution (faster, as the drafts pass more often).
    typical: bool = False
    typical_threshold: float = 0.09
    typical_alpha: float = 0.3
    num_beams: int = 4
    beam_top_k: int | None = None
    length_penalty: float = 1.0
    min_length: int = 0

    def __post_init__(self):
        for name, bounds in BOUNDS.items():
            bounds(name, getattr(self, name))
        integer("lookup_min_ngram", self.lookup_min_ngram, 1, self.lookup_max_ngram)


# Each setting's bounds, written once: StrategySettings checks them all, and a strategy's or a drafter's constructor
# checks what it is given with `check`, so both refuse the same values in the same words.
BOUNDS: dict[str, Callable[[str, Any], Any]] = {
    # At most 64: a longer chain only costs drafter forwards (even a drafter the target agrees with 19 times in 20
    # has its 65th draft reached in under 4% of rounds, 0.95 ** 64), and an export hands the engines no more.
    "gamma": lambda s, v: integer(s, v, 1, 64),
    "draft_confidence": lambda s, v: number(s, v, 0, 1, high_open=True),
    "draft_adaptive": switch,
    "draft_cumulative": lambda s, v: number(s, v, 0, 1, high_open=True),
    "draft_alternatives": lambda s, v: integer(s, v, 0, 8),
    "verify_width": lambda s, v: integer(s, v, 2, 64),  # the last committed token and at least one draft
    "copy_gamma": lambda s, v: integer(s, v, 1),
    "auto_min_match": lambda s, v: integer(s, v, 1, 16),
    "ngram_n": lambda s, v: integer(s, v, 2, 16),
    "ngram_kind": lambda s, v: choice(s, v, STORE_KINDS),
    "ngram_filler_top_k": lambda s, v: integer(s, v, 0, 64),
    "ngram_reset_each_prompt": switch,
    "lookup_max_ngram": lambda s, v: integer(s, v, 1, 16),
    "lookup_min_ngram": lambda s, v: integer(s, v, 1, 16),  # and at most lookup_max_ngram
    "lookahead_window": lambda s, v: integer(s, v, 2, 16),  # row 0 is the last token and at least one guess
    "lookahead_ngram": lambda s, v: integer(s, v, 2, 8),
    "lookahead_candidates": lambda s, v: integer(s, v, 0, 16),  # 0: the Jacobi window's guesses alone
    "head_branch": lambda s, v: integer(s, v, 1, 16),
    "head_cumulative": lambda s, v: number(s, v, 0, 1, high_open=True),
    "head_lookup": switch,
    "session_min_match": lambda s, v: _off_or(s, v, 4, 16),  # sampling/drafters/session.py: KEY to LONGEST
    "typical": switch,
    "typical_threshold": lambda s, v: number(s, v, 0, 1),
    "typical_alpha": lambda s, v: number(s, v, 0, 1),
    "num_beams": lambda s, v: integer(s, v, 1, 64),
    "beam_top_k": lambda s, v: None if v is None else integer(s, v, 1),
    "length_penalty": lambda s, v: number(s, v, -math.inf, math.inf),
    "min_length": lambda s, v: integer(s, v, 0),
}


def _off_or(setting: str, value: Any, low: int, high: int) -> int:
    """0 (off), or an integer from `low` to `high`."""
    number = integer(setting, value, 0, high)
    if 0 < number < low:
        raise SettingError(setting, f"must be 0 (off) or an integer from {low} to {high}", value)
    return number


def check(setting: str, value: Any) -> Any:
    """`value` as the int or float `setting` takes, if it is within that setting's bounds; else a SettingError."""
    return BOUNDS[setting](setting, value)
