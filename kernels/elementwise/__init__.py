"""Fused elementwise kernels of the decoder layer (RMSNorm, gated RMSNorm, SiLU-and-multiply), with backwards."""

from .fused import (
    RMSNormVariant,
    gated_rms_norm,
    gated_rms_norm_fn,
    gated_rms_norm_reference,
    kernels_ok,
    rms_norm,
    rms_norm_fn,
    rms_norm_ok,
    rms_norm_reference,
    silu_mul,
    silu_mul_fn,
    silu_mul_reference,
)

__all__ = [
    "RMSNormVariant",
    "gated_rms_norm",
    "gated_rms_norm_fn",
    "gated_rms_norm_reference",
    "kernels_ok",
    "rms_norm",
    "rms_norm_fn",
    "rms_norm_ok",
    "rms_norm_reference",
    "silu_mul",
    "silu_mul_fn",
    "silu_mul_reference",
]
