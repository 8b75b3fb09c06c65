"""Chosen rows of a pinned host table gathered by the GPU itself (a Triton kernel), and its torch reference."""

from .gather import gather_rows_kernel, gather_rows_kernel_available
from .naive import naive_gather_rows

__all__ = ["gather_rows_kernel", "gather_rows_kernel_available", "naive_gather_rows"]
