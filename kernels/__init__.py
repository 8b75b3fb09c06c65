"""Kernels for longstraw_trl (installed as ``longstraw_trl.kernels``)."""

from .causal_conv1d import causal_conv1d_with_state
from .gated_delta_rule import (
    chunk_gated_delta_rule_torch,
    fla_available,
    fla_backward_allowed,
    fla_chunk_backward_ready,
    gated_delta_rule,
)
from .gated_delta_rule_naive import recurrent_gated_delta_rule_ref

__all__ = [
    "causal_conv1d_with_state",
    "chunk_gated_delta_rule_torch",
    "fla_available",
    "fla_backward_allowed",
    "fla_chunk_backward_ready",
    "gated_delta_rule",
    "recurrent_gated_delta_rule_ref",
]
