"""Run a function in N processes (torch.multiprocessing), failing instead of hanging."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
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


ACCELERATE_DIR = Path(__file__).parent.parent / "examples" / "accelerate"
CP_STEP = Path(__file__).parent / "_cp_step.py"


def accelerate_launch(
    config: Path,
    script_and_args: list[str],
    *,
    num_processes: int | None = None,
    mixed_precision: str = "no",
    cwd: Path | None = None,
    timeout: float = 300.0,
) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file config [...] script args`` in a subprocess, on a free port (``0``: tests
    run side by side under pytest-xdist, and Accelerate's default, 29500, would collide), one thread per rank."""
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "--main_process_port",
        "0",
    ]
    if num_processes is not None:
        cmd += ["--num_processes", str(num_processes)]
    cmd += ["--mixed_precision", mixed_precision, *map(str, script_and_args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout, check=False)


def launch_step(config: Path, out: Path, *args: str, num_processes: int | None = None, **kwargs) -> dict:
    """One ``tests/_cp_step.py`` step under ``accelerate launch`` (:func:`accelerate_launch`): the JSON it wrote."""
    proc = accelerate_launch(config, [CP_STEP, "--out", out, *args], num_processes=num_processes, **kwargs)
    assert proc.returncode == 0, _failure_report(proc.stderr)
    return json.loads(Path(out).read_text())


def _failure_report(stderr: str) -> str:
    """A launched world's failure: the lines of every rank that name an error or a native abort (a rank that dies
    by a signal prints them long before the launcher's summary at the end), then the tail."""
    marks = ("Error", "terminate called", "Abort", "what():", "Traceback", "SIG")
    lines = [line for line in stderr.splitlines() if any(m in line for m in marks)]
    return "\n".join(lines[:40]) + "\n----- tail -----\n" + stderr[-2000:]


def relative_l2(got, ref: torch.Tensor) -> float:
    """``|got - ref| / |ref|`` (``got`` a tensor or a list from a step's JSON)."""
    return float((torch.as_tensor(got) - ref).norm() / ref.norm().clamp_min(1e-12))


def free_port() -> int:
    """A TCP port free on this host now (for a spawned world's ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_rank(rank: int, world: int, port: int) -> None:
    """Make this spawned process rank ``rank`` of a ``world``-process launch on ``port`` (the environment
    ``accelerate launch`` / torchrun would give it, so the trainer's Accelerator joins the group), one thread."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
