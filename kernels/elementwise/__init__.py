"""Fused elementwise kernels of the decoder layer (RMSNorm, gated RMSNorm, SiLU-and-multiply), with backwards
(``fused``), and their plain torch references (``naive``)."""

from .fused import (
    elementwise_available,
    gated_rms_norm,
    gated_rms_norm_fn,
    rms_norm,
    rms_norm_available,
    rms_norm_fn,
    silu_mul,
    silu_mul_fn,
)
from .naive import RMSNormVariant, naive_gated_rms_norm, naive_rms_norm, naive_silu_mul

__all__ = [
    "RMSNormVariant",
    "elementwise_available",
    "gated_rms_norm",
    "gated_rms_norm_fn",
    "naive_gated_rms_norm",
    "naive_rms_norm",
    "naive_silu_mul",
    "rms_norm",
    "rms_norm_available",
    "rms_norm_fn",
    "silu_mul",
    "silu_mul_fn",
]
