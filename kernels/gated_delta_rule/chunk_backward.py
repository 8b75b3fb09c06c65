"""The gated ``chunk_bwd_dqkwg`` step of flash-linear-attention's chunked Gated DeltaNet backward, in torch.

fla (0.6.0) refuses its own Triton kernel for this step on Hopper with ``3.4.0 <= Triton < 3.7.1`` (a miscompile
gives wrong gradients, https://github.com/fla-org/flash-linear-attention/issues/640); the rest of its backward is
allowed. The step is local to each 64-token chunk once the per-chunk states ``h`` and their gradients ``dh`` are
known, so it is a handful of batched matmuls over all chunks (fp32 accumulation, no Triton). ``gated_delta_rule``
registers it as an fla backend (the ``gdn_backward`` switch).

Per value head ``hv`` (q/k head ``hv // (HV // H)``) and chunk ``n`` of positions ``i, j``, with ``g`` fla's
chunk-local cumulative log2 decay (``g_i = sum_{t <= i in the chunk} log_decay_t / ln 2``), ``g_L`` its value at
the chunk's last position, ``h`` the state before the chunk and ``dh`` the gradient of the state after it, ``v``
the corrected values (``v_new = u - w h``) and ``dv`` their gradient, the step returns the gradients that the
chunk's output ``o_i = scale 2^{g_i} q_i h + sum_{j <= i} scale 2^{g_i - g_j} (q_i . k_j) v_j``, its state
update ``h' = 2^{g_L} h + sum_j 2^{g_L - g_j} k_j v_j^T`` and ``v_new`` send to q, k, w and g (natural-log units,
before fla's reverse cumulative sum), with ``v``, ``h``, ``do``, ``dh``, ``dv`` held fixed.
"""

from __future__ import annotations

import torch

__all__ = ["chunk_bwd_dqkwg_torch"]

TOKENS_PER_PASS = 8192  # chunks processed together: bounds the fp32 intermediates (~[tokens, HV, 128] each)


def _check(q, k, v, do, h, dh, w, g, g_gamma, dv, cu_seqlens, chunk_size):
    if g is None or g_gamma is not None:
        raise ValueError("chunk_bwd_dqkwg_torch serves the gated delta rule only: pass g (and no g_gamma)")
    if cu_seqlens is not None:
        raise ValueError("chunk_bwd_dqkwg_torch takes equal-length sequences only (cu_seqlens=None)")
    if (w is None) != (dv is None):
        raise ValueError("pass w and dv together (the delta rule) or neither")
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    if q.shape != k.shape or v.shape[:2] != (B, T) or HV % H:
        raise ValueError(
            f"q, k must be [B, T, H, K] and v [B, T, HV, V] with HV a multiple of H; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    NT = -(-T // chunk_size)
    if h.shape[:3] != (B, NT, HV) or dh.shape != h.shape:
        raise ValueError(
            f"h and dh must be [B, NT={NT}, HV={HV}, K, V] (one state per chunk of {chunk_size}); "
            f"got {tuple(h.shape)} and {tuple(dh.shape)}"
        )
    return B, T, H, K, HV, V, NT


def _heads_first(x: torch.Tensor, t0: int, t1: int, chunk_size: int) -> torch.Tensor:
    """``x[:, t0:t1]`` ``[B, t, heads, D]`` as contiguous fp32 chunks ``[B, n, heads, chunk_size, D]`` (one copy),
    zero rows past the end (they contribute nothing)."""
    B, heads, D = x.shape[0], x.shape[2], x.shape[3]
    n = -(-(t1 - t0) // chunk_size)
    full, rest = divmod(t1 - t0, chunk_size)
    y = (torch.zeros if rest else torch.empty)(
        B, n, heads, chunk_size, D, dtype=torch.float32, device=x.device
    )
    y[:, :full].transpose(2, 3).copy_(x[:, t0 : t0 + full * chunk_size].unflatten(1, (full, chunk_size)))
    if rest:
        y[:, full, :, :rest].copy_(x[:, t1 - rest : t1].transpose(1, 2))
    return y


def _store(dst: torch.Tensor, t0: int, t1: int, x: torch.Tensor) -> None:
    """Write chunks ``x`` ``[B, n, heads, C, D]`` into ``dst[:, t0:t1]`` ``[B, t, heads, D]`` (casting)."""
    rows = x.transpose(2, 3)  # [B, n, C, heads, D]
    if rows.shape[1] * rows.shape[2] == t1 - t0:
        dst[:, t0:t1].unflatten(1, rows.shape[1:3]).copy_(rows)
    else:  # the partial last chunk
        dst[:, t0:t1].copy_(rows.flatten(1, 2)[:, : t1 - t0])


def chunk_bwd_dqkwg_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    h: torch.Tensor,
    dh: torch.Tensor,
    w: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    scale: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    chunk_size: int = 64,
    chunk_indices: torch.LongTensor | None = None,
    *,
    tokens_per_pass: int = TOKENS_PER_PASS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """fla's gated ``chunk_bwd_dqkwg`` (same arguments and returns) as batched torch matmuls in fp32.

    Args:
        q, k: ``[B, T, H, K]``; v (fla's ``v_new``), do, dv: ``[B, T, HV, V]``; w: ``[B, T, HV, K]``;
            g: ``[B, T, HV]`` fp32, fla's chunk-local cumulative decay in log2 units.
        h, dh: ``[B, NT, HV, K, V]`` (``[.., V, K]`` with ``state_v_first``): the state before each chunk
            and the gradient of the state after it.
        scale: the query scale (default ``K ** -0.5``).
        chunk_indices: unused (equal-length sequences only); accepted for fla's signature.
        tokens_per_pass: chunks handled together per pass (memory bound of the fp32 intermediates).
    Returns:
        ``dq, dk`` ``[B, T, H, K]`` in q's / k's dtype (value heads summed onto their q/k head), ``dw``
        ``[B, T, HV, K]`` in w's dtype (None without w), ``dg`` ``[B, T, HV]`` fp32.
    """
    del chunk_indices
    B, T, H, K, HV, V, NT = _check(q, k, v, do, h, dh, w, g, g_gamma, dv, cu_seqlens, chunk_size)
    scale = K**-0.5 if scale is None else float(scale)
    R, C = HV // H, chunk_size
    dq = torch.empty(B, T, H, K, dtype=q.dtype, device=q.device)
    dk = torch.empty(B, T, H, K, dtype=k.dtype, device=k.device)
    dw = torch.empty_like(w) if w is not None else None
    dg = torch.empty(B, T, HV, dtype=torch.float32, device=g.device)
    step = max(1, tokens_per_pass // C)
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    for n0 in range(0, NT, step):
        n1 = min(NT, n0 + step)
        t0, t1 = n0 * C, min(T, n1 * C)
        nb = n1 - n0
        # head-first fp32 chunks: [B, nb, H, C, K] for q/k, [B, nb, H, R, C, D] for the value heads (R per q/k head)
        qc, kc = (_heads_first(x, t0, t1, C) for x in (q, k))
        vc, doc = (_heads_first(x, t0, t1, C).view(B, nb, H, R, C, V) for x in (v, do))
        # the decay, padded with its last value: g_L is then the last row of every chunk, the last valid one too
        gc = _heads_first(g.unsqueeze(-1), t0, t1, C).view(B, nb, H, R, C)
        if (t1 - t0) % C:
            gc[:, -1, ..., (t1 - t0) % C :] = gc[:, -1, ..., (t1 - t0) % C - 1 : (t1 - t0) % C]
        hc, dhc = (x[:, n0:n1].float().view(B, nb, H, R, *x.shape[-2:]) for x in (h, dh))
        if not state_v_first:  # the matmuls below take the states as [V, K]
            hc, dhc = hc.transpose(-1, -2), dhc.transpose(-1, -2)
        g_last = gc[..., -1]  # [B, nb, H, R]

        # the state terms: o reads 2^g_i q_i h; h' gets 2^{g_L - g_j} k_j v_j^T; v_new = u - w h
        dq_c = (doc @ hc).mul_((torch.exp2(gc) * scale).unsqueeze(-1))  # [B, nb, H, R, C, K]
        dk_c = (vc @ dhc).mul_(torch.exp2(g_last.unsqueeze(-1) - gc).unsqueeze(-1))
        dg_last = torch.einsum("bnhrvk,bnhrvk->bnhr", hc, dhc) * torch.exp2(g_last)
        dg_last += torch.einsum("bnhrik,bnhik->bnhr", dk_c, kc)
        if w is not None:
            dvc = _heads_first(dv, t0, t1, C).view(B, nb, H, R, C, V)
            _store(dw, t0, t1, (dvc @ hc).neg_().view(B, nb, HV, C, K))
            del dvc
        # the intra-chunk scores: ds_ij = scale 2^{g_i - g_j} do_i . v_j for j <= i
        decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill_(upper, float("-inf")).exp2_()
        ds = (doc @ vc.transpose(-1, -2)).mul_(decay).mul_(scale)  # [B, nb, H, R, C, C]
        del decay
        dq_c += (ds.view(B, nb, H, R * C, C) @ kc).view(B, nb, H, R, C, K)
        dk_c += torch.einsum("bnhrij,bnhik->bnhrjk", ds, qc)
        del ds
        dg_c = torch.einsum("bnhrik,bnhik->bnhri", dq_c, qc) - torch.einsum("bnhrik,bnhik->bnhri", dk_c, kc)
        # g_L is the last valid position of each chunk: its gradient collects the state terms' decay
        dg_c[..., -1] += dg_last
        if (t1 - t0) % C:  # the partial last chunk's g_L is its last valid row, not its padded last row
            dg_c[:, -1, ..., (t1 - t0) % C - 1] += dg_last[:, -1]
            dg_c[:, -1, ..., -1] -= dg_last[:, -1]
        _store(dg.unsqueeze(-1), t0, t1, dg_c.reshape(B, nb, HV, C, 1))
        _store(dq, t0, t1, dq_c.sum(3))
        _store(dk, t0, t1, dk_c.sum(3))
    return dq, dk, dw, dg
