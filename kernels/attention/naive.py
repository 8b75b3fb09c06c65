"""Plain torch attention math: the references the fast paths are tested against, and the path where no fast one
serves (soft-capped scores, ``LONGSTRAW_DISABLE=cpu_flash``, inputs the ops refuse).

``naive_attention_lse`` / ``naive_attention_grads``: softmax attention returning its log-sum-exp, and the gradients
of one key part given the *final* merged ``out`` and ``lse`` (the FlashAttention identity: with ``D_i = dO_i . O_i``,
``P_ij = exp(s_ij - lse_i)`` and ``dS_ij = P_ij (dO_i . v_j - D_i)``, the part contributes
``dQ_i = scale * sum_j dS_ij k_j``). Keys are processed in blocks, so no fp32 score tile larger than
:data:`MATH_TILE_ELEMENTS` is alive at once. ``naive_prompt_dq``: the math of the prompt-page dQ kernel
(:mod:`.prompt_dq`) in one matmul over all keys.
"""

from __future__ import annotations

import torch

from .merge import merge_partials

# The plain-math path processes keys in blocks so that one fp32 score tile stays under this many
# elements (1 GiB), whatever the number of query rows.
MATH_TILE_ELEMENTS = 1 << 28


def _key_block(q: torch.Tensor) -> int:
    rows = q.numel() // q.shape[-1]
    return max(128, min(1 << 16, MATH_TILE_ELEMENTS // max(rows, 1)))


def attention_scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None = None
) -> torch.Tensor:
    """fp32 scores ``q k^T * scale``, soft-capped to ``softcap * tanh(s / softcap)`` when given (Gemma 2:
    the cap applies to every score before the softmax, so the LSE of each part is over capped scores)."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    return s


def naive_attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = False,
    q_offset: int = 0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention returning ``(out fp32, lse fp32)`` for equal head counts ``[..., T, D]``.

    ``causal`` masks key ``j`` for query ``i`` when ``j > i + q_offset``; keys are processed in blocks
    with an online log-sum-exp so no ``[T, L]`` fp32 tile larger than one block is alive at once.
    ``softcap``: scores are soft-capped before the softmax (see :func:`attention_scores`).
    """
    out, lse = None, None
    block = _key_block(q)
    for start in range(0, k.shape[-2], block):
        kb = k[..., start : start + block, :]
        vb = v[..., start : start + block, :]
        s = attention_scores(q, kb, scale, softcap)
        if causal:
            qi = torch.arange(q.shape[-2], device=q.device)[:, None] + q_offset
            kj = torch.arange(start, start + kb.shape[-2], device=q.device)[None, :]
            s = s.masked_fill(kj > qi, float("-inf"))
        m = s.amax(-1)
        m = torch.where(torch.isinf(m), 0.0, m)  # rows with every key masked: p = 0, lse = -inf
        p = torch.exp(s - m.unsqueeze(-1))
        total = p.sum(-1)
        lse_b = m + torch.log(total)
        out_b = torch.matmul(p, vb.float()) / total.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
        out, lse = merge_partials(out, lse, out_b, lse_b)
    if out is None:  # no keys at all
        shape = q.shape[:-1]
        return q.new_zeros((*shape, v.shape[-1]), dtype=torch.float32), q.new_full(
            shape, float("-inf"), dtype=torch.float32
        )
    return out, lse


def naive_attention_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    scale: float,
    causal: bool = False,
    q_offset: int = 0,
    need_kv: bool = True,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of one key part given the *final* merged ``out``/``lse`` (fp32 results).

    ``need_kv=False`` (prompt pages) skips dK/dV. ``softcap``: the scores were soft-capped, so ``dS``
    is taken through ``d(c tanh(x / c)) / dx = 1 - tanh(x / c)^2`` back to the raw scores.
    """
    dout = dout.float()
    delta = (dout * out.float()).sum(-1, keepdim=True)
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk = torch.zeros_like(k, dtype=torch.float32) if need_kv else None
    dv = torch.zeros_like(v, dtype=torch.float32) if need_kv else None
    qf = q.float()
    block = _key_block(q)
    for start in range(0, k.shape[-2], block):
        kb = k[..., start : start + block, :].float()
        vb = v[..., start : start + block, :].float()
        s = attention_scores(qf, kb, scale, softcap)
        # s = c tanh(raw / c): d s / d raw = 1 - (s / c)^2 (taken before masking: no inf * 0)
        cap_grad = 1 - (s / softcap).square() if softcap is not None else None
        if causal:
            qi = torch.arange(q.shape[-2], device=q.device)[:, None] + q_offset
            kj = torch.arange(start, start + kb.shape[-2], device=q.device)[None, :]
            s = s.masked_fill(kj > qi, float("-inf"))
        p = torch.exp(s - lse.unsqueeze(-1))
        ds = p * (torch.matmul(dout, vb.transpose(-1, -2)) - delta)
        if cap_grad is not None:
            ds = ds * cap_grad
        dq += torch.matmul(ds, kb) * scale
        if need_kv:
            dk[..., start : start + kb.shape[-2], :] = torch.matmul(ds.transpose(-1, -2), qf) * scale
            dv[..., start : start + kb.shape[-2], :] = torch.matmul(p.transpose(-1, -2), dout)
    return dq, dk, dv


def naive_prompt_dq(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dout: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The math of :func:`prompt_dq` in fp32 torch (one matmul over all keys: small problems and tests)."""
    qf, kf, vf, df = (x.float() for x in (q, k, v, dout))
    p = torch.exp(scale * qf @ kf.transpose(-1, -2) - lse.float().unsqueeze(-1))
    ds = p * (df @ vf.transpose(-1, -2) - delta.float().unsqueeze(-1))
    return scale * ds @ kf
