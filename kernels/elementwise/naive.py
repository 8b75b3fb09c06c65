"""The plain torch references of the fused elementwise kernels: HF's own math, written out cast for cast."""

from __future__ import annotations

from typing import Literal

import torch

RMSNormVariant = Literal["zero_centered", "llama", "gpt_oss"]


RMS_NORM_VARIANTS = {"zero_centered": 0, "llama": 1, "gpt_oss": 2}


def _norm_fp32(x: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's ``x_fp32 * rsqrt(mean(x_fp32 ** 2) + eps)``."""
    xf = x.to(torch.float32)
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def naive_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, variant: RMSNormVariant
) -> torch.Tensor:
    """The math of :func:`rms_norm` in plain torch: HF's forwards, cast for cast."""
    n = _norm_fp32(x, eps)
    if variant == "zero_centered":
        return (n * (1.0 + weight.float())).type_as(x)
    if variant == "llama":
        return weight * n.to(x.dtype)
    if variant == "gpt_oss":
        return (weight * n).to(x.dtype)
    raise ValueError(f"unknown RMSNorm variant {variant!r}; expected one of {sorted(RMS_NORM_VARIANTS)}")


def naive_gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """The math of :func:`gated_rms_norm` in plain torch (``Qwen3_5RMSNormGated.forward``)."""
    out = weight * _norm_fp32(x, eps).to(x.dtype)
    out = out * torch.nn.functional.silu(gate.to(torch.float32))
    return out.to(x.dtype)


def naive_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The math of :func:`silu_mul` in plain torch (``act_fn(gate_proj(x)) * up_proj(x)``)."""
    return torch.nn.functional.silu(gate) * up
