"""Verification of a draft against the target: pure functions on tensors, one host sync each.

Notation as in Leviathan et al. / Chen et al.: `p` is the target's distribution, `q` the drafter's.
Both take the draft `x` of k tokens and the target's output at the k+1 positions that follow the last committed
token (k for the drafts and one bonus position), and return (number of drafts accepted, the token to commit after
them: the target's correction on a rejection, the bonus token when all were accepted).
"""

from __future__ import annotations

import torch
from torch import Tensor

from utils.logits_processor import sample


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
    # Residual mass 0 means p <= q everywhere, i.e. p == q: rejection then has probability 0; fall back to p
    # (0/0 guard).
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), p[:k])
    next_dist = torch.cat([residual, p[k:]])  # (k+1, V): correction at each rejection point, then the bonus
    choices = sample(next_dist, generator)  # (k+1,), no sync yet
    n, token = torch.stack([n, choices[n]]).tolist()
    return n, token


# Token trees: several deterministic candidates verified in one forward (lookahead's n-grams and Jacobi window).
# x: (T,) tokens; parents: (T,) each token's parent (< its own index), -1 for the root, i.e. the last committed token.
# The target's rows are the root's first, then one per token: row i + 1 is token i. Both functions return
# (the last accepted token's index, -1 for none; the token to commit after it).


def accept_tree_greedy(x: Tensor, parents: Tensor, target_logits: Tensor) -> tuple[int, int]:
    """The deepest token whose whole path from the root equals the target's argmax; then emit the target's argmax.

    target_logits: (T+1, V).
    """
    best = target_logits.argmax(-1)  # (T+1,)
    match = torch.cat([best.new_ones(1, dtype=torch.bool), x == best[parents + 1]])  # (T+1,)
    on_path, depth = _along_paths(match, parents)
    row = torch.where(on_path, depth, -1).argmax()
    row, token = torch.stack([row, best[row]]).tolist()
    return row - 1, token


def accept_tree_stochastic(x: Tensor, parents: Tensor, p: Tensor, generator: torch.Generator | None) -> tuple[int, int]:
    """The deterministic-draft rule tried on several candidates (SpecInfer's multi-round rejection, one-hot drafts).

    From the root, a node's children are tried in index order: each is accepted with probability p(x) under the
    node's p with the tokens already rejected there removed and renormalised (a repeated token: probability 0); the
    first accepted child becomes the node. Where every child is rejected (at a leaf: none to try), the token is
    sampled from p with all the children's tokens removed. Every trial draws its own uniform, so the committed
    tokens follow p exactly. p: (T+1, V) target probabilities.
    """
    t = len(x)
    rows = parents + 1  # (T,) the row each token is verified at
    p_x = p[rows, x]  # (T,)
    earlier = torch.ones(t, t, dtype=torch.bool, device=p.device).tril(-1)
    before = (rows[:, None] == rows[None, :]) & earlier  # (T, T) [i, j]: j is an earlier sibling of i
    repeat = (before & (x[:, None] == x[None, :])).any(-1)  # (T,) an earlier sibling has the same token
    removed = (before & ~repeat).to(p.dtype) @ p_x  # (T,) mass already rejected at the parent
    u = torch.rand(t, generator=generator, device=p.device, dtype=p.dtype)
    accepted = ~repeat & (u * (1 - removed).clamp_min(0.0) < p_x)  # u < p_x / (1 - removed)
    taken = accepted & ~(before & accepted).any(-1)  # the first accepted child of each node
    on_path, depth = _along_paths(torch.cat([taken.new_ones(1), taken]), parents)
    residual = p.index_put((rows, x), p.new_zeros(()))  # each row without its children's tokens
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), p)  # 0/0 guard as above
    choices = sample(residual, generator)  # (T+1,), no sync yet
    row = torch.where(on_path, depth, -1).argmax()
    row, token = torch.stack([row, choices[row]]).tolist()
    return row - 1, token


def _along_paths(flag: Tensor, parents: Tensor) -> tuple[Tensor, Tensor]:
    """Per row (root first): whether `flag` holds on every row from the root to it, and its depth (pointer jumping:
    after s steps each row has folded in its 2**s nearest ancestors; the root is its own parent)."""
    up = torch.cat([parents.new_zeros(1), parents + 1])  # (T+1,) parent row
    depth = (up != torch.arange(len(up), device=up.device)).long()
    for _ in range(max(len(up) - 1, 1).bit_length()):
        flag, depth, up = flag & flag[up], depth + depth[up], up[up]
    return flag, depth


def accept_tree_typical(x: Tensor, parents: Tensor, p: Tensor, threshold: float, alpha: float,
                        generator: torch.Generator | None) -> tuple[int, int]:
    """Medusa's typical acceptance, NOT lossless: a token passes where the target gives it more than
    min(threshold, alpha * exp(-entropy)) at its parent's row; the deepest path of passing tokens is kept, and the
    token after it is sampled from p there. The output then no longer follows p exactly (it favours the drafts).

    p: (T+1, V) target probabilities; a chain is the tree whose parents are -1, 0, 1, ...
    """
    rows = parents + 1
    entropy = -(p * p.clamp_min(torch.finfo(p.dtype).tiny).log()).sum(-1)  # (T+1,)
    floor = torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))
    passes = p[rows, x] > floor[rows]
    on_path, depth = _along_paths(torch.cat([passes.new_ones(1), passes]), parents)
    row = torch.where(on_path, depth, -1).argmax()
    choices = sample(p, generator)  # (T+1,)
    row, token = torch.stack([row, choices[row]]).tolist()
    return row - 1, token
