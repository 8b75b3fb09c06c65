"""Token-by-token reference for the gated delta rule (the ``naive.py`` beside the chunked kernel).

Per value head, with ``S`` the ``[K, V]`` state, ``q`` scaled by ``scale`` (default ``K ** -0.5``):

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T
    o_t = S_t^T q_t

This is slow and plain on purpose: every fast path is tested against it.
"""

from __future__ import annotations

import torch

__all__ = ["l2norm", "recurrent_gated_delta_rule_ref"]


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x * x) + eps)``, as in HF's Qwen3.5 and in flash-linear-attention."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def recurrent_gated_delta_rule_ref(
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
