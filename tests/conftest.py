"""Shared pytest setup."""

from __future__ import annotations

import os
import sys

import pytest
import torch

# Without CUDA, Triton kernels can only run in its interpreter (on CPU tensors), and Triton decorates its own
# library functions (tl.sum, ...) when it is first imported: switch the interpreter on before any test module imports
# Triton. Nothing runs in it unless a test asks (the interpreter fixtures of the kernel tests); TRITON_INTERPRET set
# by the caller is left as it is.
if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: the test models are tiny (threads only add overhead; on a busy 2-core VM, thread
    wake-ups made tiny matmuls ~100x slower), and timings stay stable. Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` run only with ``LONGSTRAW_SLOW=1`` (``make test`` stays within its time budget)."""
    if os.environ.get("LONGSTRAW_SLOW", "") in ("1", "true", "yes", "on"):
        return
    skip = pytest.mark.skip(reason="slow: run with LONGSTRAW_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
