"""The gated ``chunk_bwd_dqkwg`` step of flash-linear-attention's chunked Gated DeltaNet backward, in torch.

fla (0.6.0) refuses its own Triton kernel for this step on Hopper with ``3.4.0 <= Triton < 3.7.1`` (a miscompile
gives wrong gradients, fla issue #640); the rest of its backward is allowed. The step is local to each 64-token
chunk once the per-chunk states ``h`` and their gradients ``dh`` are known, so it is a handful of batched matmuls
over all chunks (fp32 accumulation, no Triton). ``gated_delta_rule`` registers it as an fla backend
(``LONGSTRAW_GDN_BACKWARD``).

Per value head ``hv`` (q/k head ``hv // (HV // H)``) and chunk ``n`` of positions ``i, j``, with ``g`` fla's
chunk-local cumulative log2 decay (``g_i = sum_{t <= i in the chunk} log_decay_t / ln 2``), ``g_L`` its value at
the chunk's last position, ``h`` the state before the chunk and ``dh`` the gradient of the state after it, ``v``
the corrected values (``v_new = u - w h``) and ``dv`` their gradient, the step returns the gradients that the
chunk's output ``o_i = scale 2^{g_i} q_i h + sum_{j <= i} scale 2^{g_i - g_j} (q_i . k_j) v_j``, its state
update ``h' = 2^{g_L} h + sum_j 2^{g_L - g_j} k_j v_j^T`` and ``v_new`` send to q, k, w and g (natural-log units,
before fla's reverse cumulative sum), with ``v``, ``h``, ``do``, ``dh``, ``dv`` held fixed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["chunk_bwd_dqkwg_reference", "chunk_bwd_dqkwg_torch"]

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


def _chunks(x: torch.Tensor, t0: int, t1: int, chunk_size: int) -> torch.Tensor:
    """``x[:, t0:t1]`` ``[B, t, heads, D]`` as fp32 chunks ``[B, n, chunk_size, heads, D]``, zero rows past the
    end (they contribute nothing)."""
    pad = (-(t1 - t0)) % chunk_size
    x = F.pad(x[:, t0:t1].float(), (0, 0, 0, 0, 0, pad))
    return x.reshape(x.shape[0], -1, chunk_size, *x.shape[2:])


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
    for n0 in range(0, NT, step):
        n1 = min(NT, n0 + step)
        t0, t1 = n0 * C, min(T, n1 * C)
        nb, pad = n1 - n0, (n1 - n0) * C - (t1 - t0)

        qc, kc = (_chunks(x, t0, t1, C) for x in (q, k))  # [B, nb, C, H, K]
        vc, doc = (_chunks(x, t0, t1, C).reshape(B, nb, C, H, R, V) for x in (v, do))
        gs = g[:, t0:t1].float()
        # pad the decay with its last value: g_L is then the last row of every chunk, the last valid one included
        gs = torch.cat([gs, gs[:, -1:].expand(B, pad, HV)], dim=1) if pad else gs
        gc = gs.reshape(B, nb, C, H, R)
        hc, dhc = (x[:, n0:n1].float().reshape(B, nb, H, R, *x.shape[-2:]) for x in (h, dh))
        if state_v_first:  # [V, K] -> [K, V]
            hc, dhc = hc.transpose(-1, -2), dhc.transpose(-1, -2)
        g_last = gc[:, :, -1]  # [B, nb, H, R]

        # the state terms: o reads 2^g_i q_i h; h' gets 2^{g_L - g_j} k_j v_j^T; v_new = u - w h
        dq_c = torch.einsum("bnihrv,bnhrkv->bnihrk", doc, hc) * (torch.exp2(gc) * scale).unsqueeze(-1)
        to_end = torch.exp2(g_last.unsqueeze(2) - gc).unsqueeze(
            -1
        )  # decay from each position to the chunk end
        dk_c = torch.einsum("bnihrv,bnhrkv->bnihrk", vc, dhc) * to_end
        dg_last = (hc * dhc).sum((-2, -1)) * torch.exp2(g_last) + torch.einsum("bnihrk,bnihk->bnhr", dk_c, kc)
        if w is not None:
            dvc = _chunks(dv, t0, t1, C).reshape(B, nb, C, H, R, V)
            dw_c = -torch.einsum("bnihrv,bnhrkv->bnihrk", dvc, hc)
            dw[:, t0:t1] = dw_c.reshape(B, nb * C, HV, K)[:, : t1 - t0].to(dw.dtype)
            del dw_c
        # the intra-chunk scores: ds_ij = scale 2^{g_i - g_j} do_i . v_j for j <= i
        gt = gc.permute(0, 1, 3, 4, 2)  # [B, nb, H, R, C]
        upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
        decay = (gt.unsqueeze(-1) - gt.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp2()
        ds = torch.einsum("bnihrv,bnjhrv->bnhrij", doc, vc) * decay * scale
        del decay
        dq_c = dq_c + torch.einsum("bnhrij,bnjhk->bnihrk", ds, kc)
        dk_c = dk_c + torch.einsum("bnhrij,bnihk->bnjhrk", ds, qc)
        del ds
        dg_c = torch.einsum("bnihrk,bnihk->bnihr", dq_c, qc) - torch.einsum("bnihrk,bnihk->bnihr", dk_c, kc)
        dg_c = dg_c.reshape(B, nb * C, HV)
        # g_L is the last valid position of each chunk: its gradient collects the state terms' decay
        last_rows = (torch.arange(nb, device=q.device) * C + C - 1).clamp_max(t1 - t0 - 1)
        dg_c[:, last_rows] += dg_last.reshape(B, nb, HV)
        dg[:, t0:t1] = dg_c[:, : t1 - t0]
        dq[:, t0:t1] = dq_c.sum(4).reshape(B, nb * C, H, K)[:, : t1 - t0].to(dq.dtype)
        dk[:, t0:t1] = dk_c.sum(4).reshape(B, nb * C, H, K)[:, : t1 - t0].to(dk.dtype)
    return dq, dk, dw, dg


def chunk_bwd_dqkwg_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    h: torch.Tensor,
    dh: torch.Tensor,
    w: torch.Tensor,
    g: torch.Tensor,
    dv: torch.Tensor,
    scale: float,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same gradients by autograd of the chunk's formulas (module docstring), one chunk and value head at a
    time in float64: the plain reference of :func:`chunk_bwd_dqkwg_torch` (slow; tests only)."""
    B, T, H, K = k.shape
    HV = v.shape[2]
    R = HV // H
    outs = [torch.zeros(B, T, H, K, dtype=torch.float64) for _ in range(2)]
    dw_ref = torch.zeros(B, T, HV, K, dtype=torch.float64)
    dg_ref = torch.zeros(B, T, HV, dtype=torch.float64)
    for b in range(B):
        for n, t0 in enumerate(range(0, T, chunk_size)):
            t1 = min(T, t0 + chunk_size)
            for hv in range(HV):
                hk = hv // R
                qi = q[b, t0:t1, hk].double().requires_grad_()
                ki = k[b, t0:t1, hk].double().requires_grad_()
                wi = w[b, t0:t1, hv].double().requires_grad_()
                gi = (g[b, t0:t1, hv].double() * math.log(2)).requires_grad_()  # natural-log units
                vi, doi, dvi = (x[b, t0:t1, hv].double() for x in (v, do, dv))
                hi, dhi = h[b, n, hv].double(), dh[b, n, hv].double()
                mask = torch.ones(t1 - t0, t1 - t0, dtype=torch.bool).tril()
                scores = torch.where(mask, (qi @ ki.T) * (gi[:, None] - gi[None, :]).exp(), 0.0) * scale
                o = scale * gi.exp()[:, None] * (qi @ hi) + scores @ vi
                h_next = gi[-1].exp() * hi + (ki * (gi[-1] - gi).exp()[:, None]).T @ vi
                loss = (o * doi).sum() + (h_next * dhi).sum() - ((wi @ hi) * dvi).sum()
                gq, gk, gw, gg = torch.autograd.grad(loss, (qi, ki, wi, gi))
                outs[0][b, t0:t1, hk] += gq
                outs[1][b, t0:t1, hk] += gk
                dw_ref[b, t0:t1, hv] = gw
                dg_ref[b, t0:t1, hv] = gg
    return outs[0], outs[1], dw_ref, dg_ref
