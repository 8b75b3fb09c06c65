"""Shared pytest setup."""

from __future__ import annotations

import os

import pytest
import torch

# Without CUDA, Triton kernels can only run in Triton's interpreter (on CPU tensors), and triton reads this when
# it is first imported (its own helpers are jit functions): set it before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: the test models are tiny (threads only add overhead; on a busy 2-core VM, thread
    wake-ups made tiny matmuls ~100x slower), and timings stay stable. Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
