"""The exact merge of partial attentions over disjoint key sets, and the grouped-query layouts the parts use.

A query that attends to two disjoint key sets gets ``(out, lse)`` from each; they compose exactly:

    lse = logaddexp(lse_a, lse_b),   out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

A sink logit (GPT-OSS) is one more such term: a key with a fixed score and a zero value (:func:`merge_sink`).
"""

from __future__ import annotations

import torch


def fold_gqa(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[B, Hq, T, D] -> [Hkv, B * rep * T, D]``: query heads of one KV group become extra rows."""
    b, hq, t, d = q.shape
    rep = hq // num_kv_heads
    return q.view(b, num_kv_heads, rep, t, d).permute(1, 0, 2, 3, 4).reshape(num_kv_heads, b * rep * t, d)


def unfold_gqa(x: torch.Tensor, batch: int, num_q_heads: int, seq: int) -> torch.Tensor:
    """Inverse of :func:`fold_gqa` for ``[Hkv, rows, ...]`` (out ``[..., D]`` or lse ``[...]``)."""
    hkv = x.shape[0]
    rep = num_q_heads // hkv
    tail = x.shape[2:]
    return (
        x.view(hkv, batch, rep, seq, *tail)
        .permute(1, 0, 2, 3, *range(4, 4 + len(tail)))
        .reshape(batch, num_q_heads, seq, *tail)
    )


def repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    """``[B, Hkv, T, D] -> [B, Hkv * rep, T, D]`` (HF's grouped-query expansion)."""
    if rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, rep, t, d).reshape(b, h * rep, t, d)


def merge_partials(
    out_a: torch.Tensor | None, lse_a: torch.Tensor | None, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two partial attentions over disjoint key sets (fp32 ``out`` and ``lse``)."""
    if out_a is None:
        return out_b, lse_b
    lse = torch.logaddexp(lse_a, lse_b)
    # A part with no keys has lse = -inf; exp(-inf - finite) = 0 keeps it out.
    out = torch.exp(lse_a - lse).unsqueeze(-1) * out_a + torch.exp(lse_b - lse).unsqueeze(-1) * out_b
    return out, lse


def merge_sink(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One more term of the LSE merge: a per-head sink logit ``sinks [Hq]`` in every row's softmax
    denominator (GPT-OSS), i.e. a key with score ``sinks[h]`` and a zero value. ``out [B, Hq, T, D]``,
    ``lse [B, Hq, T]`` fp32; ``None``: unchanged. Differentiable (the window path relies on autograd)."""
    if sinks is None:
        return out, lse
    sink = sinks.float().view(1, -1, 1).expand_as(lse)
    total = torch.logaddexp(lse, sink)
    return out * torch.exp(lse - total).unsqueeze(-1), total
