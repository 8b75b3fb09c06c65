"""Shared pytest setup."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: the test models are tiny (threads only add overhead; on a busy 2-core VM, thread
    wake-ups made tiny matmuls ~100x slower), and timings stay stable. Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
