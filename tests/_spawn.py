"""Run a function in N processes (torch.multiprocessing), failing instead of hanging."""

from __future__ import annotations

import os
import time

import pytest
import torch.multiprocessing as mp


def run_processes(fn, args: tuple, nprocs: int, timeout: float = 240.0) -> None:
    """``mp.spawn`` with a deadline: a worker stuck in a collective (or in process-group teardown) fails the
    test after ``timeout`` seconds instead of stalling the suite."""
    ctx = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"{fn.__name__}: {nprocs} processes did not finish within {timeout:.0f} s")


def exit_worker() -> None:
    """End a worker that passed, skipping interpreter teardown (DDP / process-group destructors can block
    on a peer that has already left)."""
    os._exit(0)
