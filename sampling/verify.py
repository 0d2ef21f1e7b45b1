"""Verification of a draft against the target: pure functions on tensors, one host sync each.

Notation as in Leviathan et al. / Chen et al.: `p` is the target's distribution, `q` the drafter's.
Both take the draft `x` of k tokens and the target's output at the k+1 positions that follow the last committed
token (k for the drafts and one bonus position), and return (number of drafts accepted, the token to commit after
them: the target's correction on a rejection, the bonus token when all were accepted).
"""

from __future__ import annotations

import torch
from torch import Tensor


def accept_greedy(x: Tensor, target_logits: Tensor) -> tuple[int, int]:
    """Accept while the draft equals the target's argmax; then emit the target's argmax.

    x: (k,) draft tokens; target_logits: (k+1, V).
    """
    best = target_logits.argmax(-1)  # (k+1,)
    n = (x == best[: len(x)]).cumprod(0).sum()
    n, token = torch.stack([n, best[n]]).tolist()
    return n, token


def accept_stochastic(x: Tensor, p: Tensor, q: Tensor | None, generator: torch.Generator | None) -> tuple[int, int]:
    """Speculative sampling: the committed tokens follow p exactly, whatever the draft.

    x: (k,) draft tokens; p: (k+1, V) target probabilities; q: (k, V) the probabilities the drafts were sampled
    from, or None for a deterministic draft (n-gram, lookup), which is then treated as one-hot: accept x with
    probability p(x), on rejection sample from p with x removed.
    Draft i is accepted with probability min(1, p(x_i)/q(x_i)); at the first rejection the token is sampled from
    norm(max(0, p - q)); if all k are accepted the bonus token is sampled from p[k].
    """
    k = len(x)
    p_x = p[:k].gather(-1, x[:, None]).squeeze(-1)  # (k,)
    if q is None:
        q_x = torch.ones_like(p_x)
        residual = p[:k].scatter(-1, x[:, None], 0.0)
    else:
        q_x = q.gather(-1, x[:, None]).squeeze(-1)
        residual = (p[:k] - q).clamp_min(0.0)
    u = torch.rand(k, generator=generator, device=p.device, dtype=p.dtype)
    accepted = u * q_x < p_x  # u < p/q without dividing by a zero q
    n = accepted.long().cumprod(0).sum()
    # Residual mass 0 means p <= q everywhere, i.e. p == q: rejection then has probability 0; fall back to p (0/0 guard).
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), p[:k])
    next_dist = torch.cat([residual, p[k:]])  # (k+1, V): correction at each rejection point, then the bonus
    choices = torch.multinomial(next_dist, 1, generator=generator).squeeze(-1)  # (k+1,), no sync yet
    n, token = torch.stack([n, choices[n]]).tolist()
    return n, token
