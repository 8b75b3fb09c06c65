"""Mamba-2's selective state-space scan (the SSD chunked algorithm), continuing from and returning a state."""

from .scan import mamba2_scan

__all__ = ["mamba2_scan"]
