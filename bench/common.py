"""Shared bits of the device benchmarks: model slices with real layer dimensions, timing, JSON output."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

GiB = 2**30


def git_revision() -> str:
    rev = os.environ.get("LONGSTRAW_REV")
    if rev:
        return rev
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    except Exception:  # noqa: BLE001 - the device copy may have no .git
        return "unknown"


def device_name() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}"
    return f"cpu ({platform.processor() or platform.machine()})"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Timer:
    def __enter__(self):
        sync()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        sync()
        self.seconds = time.perf_counter() - self.t0


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / GiB if torch.cuda.is_available() else float("nan")


def allocated_gib() -> float:
    return torch.cuda.memory_allocated() / GiB if torch.cuda.is_available() else float("nan")


def sdpa_causal_tflops(heads: int, kv_heads: int, head_dim: int, seq: int = 32768) -> float:
    """Measured causal SDPA rate on this device (the attention floor's denominator)."""
    q = torch.randn(1, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, kv_heads, seq, head_dim, device="cuda", dtype=torch.bfloat16)
    f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)  # noqa: E731
    f()
    with Timer() as t:
        for _ in range(5):
            f()
    flops = 4 * heads * head_dim * seq * seq / 2 * 5
    return flops / t.seconds / 1e12


def matmul_tflops(n: int = 8192) -> float:
    """Measured bf16 GEMM rate on this device (the dense floor's denominator)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    a @ b
    with Timer() as t:
        for _ in range(20):
            a @ b
    return 2 * n**3 * 20 / t.seconds / 1e12


def copy_bandwidth_gbs(gib: int = 4) -> float:
    """Measured device-memory bandwidth (bytes read + written per second by a large copy), in GB/s."""
    src = torch.empty(gib * GiB, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    with Timer() as t:
        for _ in range(10):
            dst.copy_(src)
    del src, dst
    return 2 * gib * GiB * 10 / t.seconds / 1e9


def mean_after_first(seconds: list[float]) -> float:
    """Mean of repeated timings without the first (warm-up) one; the only one if there is just one."""
    return sum(seconds[1:]) / (len(seconds) - 1) if len(seconds) > 1 else seconds[0]


def preallocate_gradients(model) -> None:
    """Zero gradients in place before a measured step, as every micro-step after the first sees them."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def write_result(name: str, payload: dict) -> Path:
    """Write ``payload`` with provenance to $OUT (device run) or bench/results/."""
    payload = {
        "benchmark": name,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_revision": git_revision(),
        "torch": torch.__version__,
        **payload,
    }
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    cols = list(rows[0])
    widths = [max(len(c), *(len(f"{r.get(c, '')}") for r in rows)) for c in cols]
    print(" | ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(f"{r.get(c, '')}".ljust(w) for c, w in zip(cols, widths, strict=True)))
