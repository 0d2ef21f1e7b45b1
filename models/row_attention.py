"""Row-by-row attention: each query row computed alone over exactly the keys it sees, so its bits do not depend on
the rows beside it.

SDPA and transformers' eager attention compute a block of query rows together over the whole cache; with some
kernels (a float32 GEMM, SDPA's blocking) a row's bits then depend on how many rows came with it and how long the
masked-out tail is, and a verify's rows round differently from the one-token steps. Here row i is the same
computation, with the same shapes, in a verify, in a tree verify (its ancestors gathered in order) and in the step
that decodes that token alone: the keys it sees, its heads grouped by key head, softmax in float32 (or wider) as
eager attention does it. In float32 on a CPU the project's C++ kernel computes it (`kernels.row_attention`: the same
rule without the Python loop, and opaque to torch.compile); in float64 or without the kernels, the loop below.
Registered with transformers' `AttentionInterface` as "rowwise"; `models.invariance` chooses it where the other
implementations are not exact.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import kernels

NAME = "rowwise"


def rowwise_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """query (B, H, Q, D), key and value (B, Hkv, K, D), attention_mask None (causal), bool (True: seen) or additive
    float (0: seen), (B, 1, Q, K); returns (B, Q, H, D)."""
    batch, heads, rows, width = query.shape
    key_heads, length = key.shape[1], key.shape[2]
    scale = width ** -0.5 if scaling is None else scaling
    if _native(query, key, value):
        seen = None if attention_mask is None else (
            attention_mask[:, 0] if attention_mask.dtype == torch.bool else attention_mask[:, 0] == 0)
        return kernels.row_attention(query, key, value, seen, scale), None
    softmax_dtype = torch.promote_types(query.dtype, torch.float32)  # float32 at least, as eager attention does
    out = query.new_empty(batch, rows, heads, value.shape[-1])
    for b in range(batch):
        seen = _seen(attention_mask, b, rows, length, query.device)  # (Q, K) bool
        counts = seen.sum(-1)
        prefix = seen.cumsum(-1).gather(-1, (counts - 1).clamp(min=0)[:, None])[:, 0] == counts
        for i, (count, is_prefix) in enumerate(zip(counts.tolist(), prefix.tolist(), strict=True)):
            if is_prefix:
                k, v = key[b, :, :count], value[b, :, :count]
            else:
                where = seen[i].nonzero()[:, 0]
                k, v = key[b].index_select(1, where), value[b].index_select(1, where)
            # (Hkv, groups, D), contiguous: as a view its strides would grow with the number of query rows, and a
            # bf16 GEMM (oneDNN on AMX) may take another path, with other bits, for another layout
            q = query[b, :, i].reshape(key_heads, heads // key_heads, width).contiguous()
            weights = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale, dim=-1, dtype=softmax_dtype)
            out[b, i] = torch.matmul(weights.to(v.dtype), v).reshape(heads, -1)
    return out, None


def _native(*tensors: Tensor) -> bool:
    """Whether the project's C++ kernel computes this attention (float32 on a CPU where the kernels load)."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors) and kernels.unavailable() is None


def _seen(mask: Tensor | None, b: int, rows: int, length: int, device: torch.device) -> Tensor:
    if mask is None:  # causal: the last `rows` keys are the rows themselves
        return torch.ones(rows, length, dtype=torch.bool, device=device).tril(length - rows)
    row = mask[b if mask.shape[0] > 1 else 0, 0]
    return row if row.dtype == torch.bool else row == 0


def register() -> None:
    """Make "rowwise" an attention implementation transformers models can switch to (`set_attn_implementation`)."""
    AttentionInterface.register(NAME, rowwise_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
