"""Direct forward-pass timings for the analytic bound: T_target(1), T_target(gamma+1), T_draft(1)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from utils.runner import CachedModel
from utils.timing import time_forward


@dataclass(frozen=True)
class ForwardCosts:
    context_length: int  # tokens already cached when the timed forwards run
    gamma: int
    repeats: int
    t_target_1: float  # seconds: one target forward over 1 new token (median)
    t_target_verify: float  # one target forward over gamma + 1 new tokens
    t_draft_1: float | None  # one drafter forward over 1 new token; None without a drafter
    t_target_verify_by_gamma: dict[int, float]  # the same for every draft length a measured strategy uses

    @property
    def draft_cost_ratio(self) -> float | None:
        """c = T_draft(1) / T_target(1)."""
        return self.t_draft_1 / self.t_target_1 if self.t_draft_1 is not None else None

    @property
    def verify_cost_ratio(self) -> float:
        """T_target(gamma+1) / T_target(1): what verifying a whole draft costs in one-token steps."""
        return self.t_target_verify / self.t_target_1

    def verify_time(self, gamma: int) -> float:
        """T_target(gamma + 1)."""
        return self.t_target_verify_by_gamma.get(gamma, self.t_target_verify)

    def as_dict(self) -> dict:
        return {**asdict(self), "draft_cost_ratio": self.draft_cost_ratio, "verify_cost_ratio": self.verify_cost_ratio}


def measure_costs(target: CachedModel, drafter: CachedModel | None, context: list[int], gamma: int,
                  repeats: int = 5, other_gammas: tuple[int, ...] = ()) -> ForwardCosts:
    """`context` is a typical prompt (its ids are only fed, never decoded): the timings hold at its length."""
    if not context:
        raise ValueError("the timing context needs at least 1 token")
    gammas = sorted({gamma, *other_gammas})
    probe = (context * (max(gammas) + 1))[-(max(gammas) + 1):]  # any tokens will do as the new ones
    by_gamma = {g: time_forward(target, context, probe[: g + 1], repeats) for g in gammas}
    return ForwardCosts(
        context_length=len(context),
        gamma=gamma,
        repeats=repeats,
        t_target_1=time_forward(target, context, probe[:1], repeats),
        t_target_verify=by_gamma[gamma],
        t_draft_1=None if drafter is None else time_forward(drafter, *_within(drafter, context, probe[:1]), repeats),
        t_target_verify_by_gamma=by_gamma,
    )


def _within(lm: CachedModel, *ids: list[int]) -> list[list[int]]:
    """Token ids the model can embed (a drafter of another tokenizer has fewer): only their count matters here."""
    return [[t % lm.vocab_size for t in part] for part in ids]


def timing_context(prompts, encode, max_new_tokens: int, limit: int) -> list[int]:
    """A typical context: the median first-turn prompt plus half the new tokens (its own ids repeated)."""
    lengths = sorted((len(ids), ids) for ids in (encode([{"role": "user", "content": p.turns[0]}]) for p in prompts))
    ids = lengths[len(lengths) // 2][1]
    wanted = min(len(ids) + max_new_tokens // 2, limit)
    return (ids * (wanted // len(ids) + 1))[:wanted]
