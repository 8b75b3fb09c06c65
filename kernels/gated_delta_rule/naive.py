"""Token-by-token reference for the gated delta rule (the ``naive.py`` beside the chunked kernel).

Per value head, with ``S`` the ``[K, V]`` state, ``q`` scaled by ``scale`` (default ``K ** -0.5``):

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T
    o_t = S_t^T q_t

This is slow and plain on purpose: every fast path is tested against it.
"""

from __future__ import annotations

import math

import torch

__all__ = ["l2norm", "naive_chunk_bwd_dqkwg", "naive_recurrent_gated_delta_rule"]


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x * x) + eps)``, as in HF's Qwen3.5 and in flash-linear-attention."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def naive_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule, one token at a time, in fp32 (fp64 inputs stay fp64: a sharper reference).

    Args:
        q, k: ``[B, T, Hk, K]``; v: ``[B, T, Hv, V]`` with ``Hv`` a multiple of ``Hk`` (each q/k head
            serves ``Hv // Hk`` consecutive value heads); g (log decay, <= 0), beta: ``[B, T, Hv]``.
        initial_state: ``[B, Hv, K, V]`` or None (zeros). Not modified; gradients flow into it if it
            requires grad (this is the mathematical reference, not the engine's constant-state kernel).
    Returns:
        ``(o [B, T, Hv, V] in q.dtype, final_state [B, Hv, K, V] fp32 (fp64 for fp64 q) or None)``.
    """
    out_dtype = q.dtype
    B, T, Hk, K = k.shape
    Hv, V = v.shape[-2:]
    if Hv != Hk:
        q = q.repeat_interleave(Hv // Hk, dim=2)
        k = k.repeat_interleave(Hv // Hk, dim=2)
    dt = torch.promote_types(q.dtype, torch.float32)
    q, k, v = (x.transpose(1, 2).to(dt) for x in (q, k, v))  # [B, H, T, D]
    g, beta = (x.transpose(1, 2).to(dt) for x in (g, beta))  # [B, H, T]
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * (K**-0.5 if scale is None else scale)

    if initial_state is None:
        S = q.new_zeros(B, Hv, K, V)
    else:
        S = initial_state.to(device=q.device, dtype=dt)
    outs = []
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]
        pred = (S * k_t[..., None]).sum(-2)  # S^T k: [B, H, V]
        delta = (v[:, :, t] - pred) * beta[:, :, t, None]
        S = S + k_t[..., None] * delta[..., None, :]
        outs.append((S * q[:, :, t, :, None]).sum(-2))
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(B, Hv, 0, V)
    o = o.transpose(1, 2).contiguous().to(out_dtype)
    return o, (S if output_final_state else None)


def naive_chunk_bwd_dqkwg(
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
