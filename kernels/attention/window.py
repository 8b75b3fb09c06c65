"""Sliding-window layers: one masked attention over [window of prompt keys | own keys], in plain torch."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .merge import merge_sink, repeat_kv
from .naive import attention_scores

# Queries per block of the window path: each block reads at most ``block + window - 1`` keys. Under
# autograd each block is checkpointed (its scores are recomputed in backward), so the graph keeps only
# the block outputs: memory grows with the response times the head dim, not with the window.
WINDOW_QUERY_BLOCK = 256


def _window_block(q, keys, values, k_pos, q_pos, scale, window, softcap, sinks):
    """One query block: ``q [B, Hq, t, D]`` over ``keys/values [B, Hq, L, D]`` at positions ``k_pos``."""
    scores = attention_scores(q, keys, scale, softcap)
    visible = (k_pos[None, :] <= q_pos[:, None]) & (q_pos[:, None] - k_pos[None, :] < window)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # every query sees at least itself: finite
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), values.float())
    return merge_sink(out, lse, sinks)[0]


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prompt_k: torch.Tensor | None,
    prompt_v: torch.Tensor | None,
    scale: float,
    window: int,
    self_length: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sliding-window attention of ``q [B, Hq, T, D]`` over the last ``n`` prompt keys
    ``prompt_k/v [Hkv, n, D]`` (shared by the batch; ``None``: none) and its own keys ``k, v [B, Hkv, S, D]``.

    Positions are relative to the call: prompt key ``j`` sits at ``j - n``, own key ``m`` at ``m``, query
    ``i`` at ``i + S - T`` (the queries are the last ``T`` own keys), or, in fixed-shape decoding, at
    ``self_length - 1`` (a 0-dim device tensor; ``S`` is then the buffer capacity and the unfilled slots
    lie after the query, so the causal condition masks them). Query at ``x`` sees key at ``y`` iff
    ``y <= x`` and ``x - y < window`` (HF's ``sliding_window_overlay`` on a causal mask). Plain torch,
    differentiable in ``q, k, v, sinks`` by autograd (blocks of :data:`WINDOW_QUERY_BLOCK` queries,
    checkpointed); ``softcap`` and ``sinks`` as in :func:`prompt_response_attention`. Returns
    ``[B, Hq, T, Dv]`` in q's dtype.
    """
    b, hq, t, _ = q.shape
    hkv, s_len = k.shape[1], k.shape[2]
    rep = hq // hkv
    n = 0 if prompt_k is None else prompt_k.shape[1]
    if n:
        keys = torch.cat([prompt_k.to(k.dtype).unsqueeze(0).expand(b, -1, -1, -1), k], dim=2)
        values = torch.cat([prompt_v.to(v.dtype).unsqueeze(0).expand(b, -1, -1, -1), v], dim=2)
    else:
        keys, values = k, v
    keys, values = repeat_kv(keys, rep), repeat_kv(values, rep)
    device = q.device
    k_pos = torch.arange(n + s_len, device=device) - n
    grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, sinks, prompt_k, prompt_v)
    )
    outs = []
    for a in range(0, t, WINDOW_QUERY_BLOCK):
        e = min(t, a + WINDOW_QUERY_BLOCK)
        if self_length is None:
            q_pos = torch.arange(a, e, device=device) + (s_len - t)
            # the keys the block can see: positions (q_pos[0] - window, q_pos[-1]]
            lo, hi = max(0, a + s_len - t - window + 1 + n), e + s_len - t + n
        else:
            q_pos, lo, hi = (self_length - 1).view(1), 0, n + s_len
        args = (q[:, :, a:e], keys[:, :, lo:hi], values[:, :, lo:hi], k_pos[lo:hi], q_pos)
        args += (scale, window, softcap, sinks)
        outs.append(checkpoint(_window_block, *args, use_reentrant=False) if grad else _window_block(*args))
    return torch.cat(outs, dim=2).to(q.dtype)
