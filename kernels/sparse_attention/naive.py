"""The plain torch reference of the DSA indexer's scores."""

from __future__ import annotations

import torch


def matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in fp32 as HF's indexer computes it (``a.float() @ b.float()``). On CUDA with half inputs the
    half GEMM with an fp32 output gives the same products (exact in fp32) with fp32 accumulation."""
    # out_dtype GEMMs have no derivative: under autograd the fp32 matmul (differentiable) serves
    graph = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and b.dtype == a.dtype and not graph:
        try:
            shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
            a3 = a.expand(*shape, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
            b3 = b.expand(*shape, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
            out = torch.bmm(a3, b3, out_dtype=torch.float32)
            return out.view(*shape, a.shape[-2], b.shape[-1])
        except (RuntimeError, TypeError):  # no fp32-output half GEMM in this build
            pass
    return torch.matmul(a.float(), b.float())


def naive_index_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q [B, T, H, D]``, ``weights [B, T, H]`` (fp32), ``keys [B or 1, L, D]`` -> ``[B, T, L]`` fp32:
    ``sum_h weights[h] * relu(scale * q_h . k)``, as HF computes it (fp32 scores, ReLU, then the weighted sum
    over heads). The heads are folded into the GEMM's rows (keys shared by the batch: the batch too), and the
    positive ``scale`` into the head weights (``relu(scale * s) = scale * relu(s)``: one pass less over the
    fp32 scores; equal up to rounding)."""
    b, t, h, d = q.shape
    if keys.shape[0] == 1:
        s = matmul_fp32(q.reshape(1, b * t * h, d), keys.transpose(-1, -2)).view(b, t, h, -1)
    else:
        s = matmul_fp32(q.reshape(b, t * h, d), keys.transpose(-1, -2)).view(b, t, h, -1)
    return torch.matmul((weights.float() * scale).unsqueeze(-2), torch.relu_(s)).squeeze(-2)
