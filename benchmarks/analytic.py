"""The analytic speedup of speculative decoding (Leviathan et al., 2023), as pure functions.

With a per-token acceptance probability `alpha` and `gamma` drafts per round, a round commits on average
E[N] = (1 - alpha^(gamma+1)) / (1 - alpha) tokens (the accepted drafts plus the target's own token). A round costs
gamma drafter forwards and one target forward over gamma + 1 tokens, so the expected speedup over plain decoding is

    S = E[N] * T_target(1) / (gamma * T_draft + T_target(gamma + 1)).

The paper writes T_target(gamma + 1) = T_target(1) and c = T_draft / T_target(1); here the verify cost is measured.
"""

from __future__ import annotations

from utils.checks import integer, number


def expected_tokens(alpha: float, gamma: int) -> float:
    """E[N], tokens committed per round: gamma + 1 when every draft is accepted, 1 when none is."""
    _check(alpha, gamma)
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speedup_bound(alpha: float, gamma: int, t_target_1: float, t_target_verify: float, t_draft: float) -> float:
    """Expected speedup over one-token-per-forward decoding, from the measured forward times (seconds)."""
    _check(alpha, gamma)
    number("t_target_1", t_target_1, 0, low_open=True)
    number("t_target_verify", t_target_verify, 0, low_open=True)
    number("t_draft", t_draft, 0)
    return expected_tokens(alpha, gamma) * t_target_1 / (gamma * t_draft + t_target_verify)


def alpha_from_counts(accepted: int, tested: int) -> float | None:
    """The per-token acceptance probability from counts: `tested` drafts were compared with the target (the accepted
    ones and the first rejected one of each round), `accepted` of them passed. None when nothing was tested."""
    tested = integer("tested", tested, 0)
    integer("accepted", accepted, 0, tested)
    return accepted / tested if tested else None


def _check(alpha: float, gamma: int) -> None:
    number("alpha", alpha, 0, 1)
    integer("gamma", gamma, 0)  # 0: plain decoding (the settings' gamma is a draft length, at least 1)
