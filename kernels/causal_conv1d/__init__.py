"""Depthwise causal conv1d continuing from a constant conv state (Gated DeltaNet's and Mamba-2's short conv)."""

from .conv import causal_conv1d_with_state

__all__ = ["causal_conv1d_with_state"]
