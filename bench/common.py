"""Shared bits of the device benchmarks: model slices with real layer dimensions, timing, JSON output."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from longstraw_trl.kernels.attention import attention_grads, attention_lse

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


def best_of(fn, n: int = 3) -> float:
    """The fastest of ``n`` timed calls of ``fn`` after one untimed (warm-up) call, in seconds."""
    fn()
    best = float("inf")
    for _ in range(n):
        with Timer() as t:
            fn()
        best = min(best, t.seconds)
    return best


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
        # the state holds the first P - 1 prompt tokens (older results lack this key)
        "state_holds_last_prompt_token": False,
        **payload,
    }
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


@contextlib.contextmanager
def process_group(backend: str, **init_kwargs) -> Iterator[None]:
    """``torch.distributed.init_process_group(backend, **init_kwargs)`` for the block, left on every exit path.

    A normal exit leaves together: a barrier, then ``destroy_process_group`` (a rank that tears gloo down while
    a peer is still inside a collective makes the peer fail with "Connection closed by peer"). An exception
    destroys the group without the barrier (a failed peer never reaches it) before it propagates, so no rank
    reaches interpreter shutdown with the group and gloo's threads alive; such an exit is the usual source of
    gloo's "terminate called without an active exception".
    """
    dist.init_process_group(backend, **init_kwargs)
    try:
        yield
    except BaseException:
        dist.destroy_process_group()
        raise
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    cols = list(rows[0])
    widths = [max(len(c), *(len(f"{r.get(c, '')}") for r in rows)) for c in cols]
    print(" | ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(f"{r.get(c, '')}".ljust(w) for c, w in zip(cols, widths, strict=True)))


# Device-agnostic rates (``--tiny`` measures them on the CPU at its own small shapes, same code path).
def gemm_tflops_at(
    shapes: list[tuple[int, int, int]], device: str, dtype: torch.dtype, iters: int = 10
) -> float:
    """Measured GEMM rate over ``(M, K, N)`` shapes: their total FLOPs over their total time."""
    flops = seconds = 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        a @ b
        with Timer() as t:
            for _ in range(iters):
                a @ b
        flops += 2 * m * k * n * iters
        seconds += t.seconds
    return flops / seconds / 1e12


def attention_tflops_at(
    heads: int,
    head_dim: int,
    queries: int,
    keys: int,
    causal: bool,
    device: str,
    dtype: torch.dtype,
    iters: int = 3,
) -> dict[str, float]:
    """Measured SDPA forward rate (4 x heads x head_dim FLOPs per visible q-k pair) per backend that runs it:
    cuDNN and flash on CUDA; SDPA's own choice on the CPU, or where neither runs.

    Keys carry all query heads (GQA expanded): the same FLOPs, and cuDNN takes no ``enable_gqa``. Causal
    runs take ``keys == queries`` (SDPA's mask is top-left aligned).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, heads, queries, head_dim, device=device, dtype=dtype)
    k = torch.randn(1, heads, keys, head_dim, device=device, dtype=dtype)
    pairs = queries * keys / 2 if causal else queries * keys
    f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=causal)  # noqa: E731
    named = (
        {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION} if device != "cpu" else {}
    )
    rates = {}
    for name, backend in [*named.items(), ("default", None)]:
        if backend is None and rates:
            break
        try:
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                f()
                with Timer() as t:
                    for _ in range(iters):
                        f()
        except RuntimeError:  # this backend does not take these shapes on this device
            continue
        rates[name] = 4 * heads * head_dim * pairs * iters / t.seconds / 1e12
    return rates


def attention_backward_tflops_at(
    kv_heads: int,
    query_heads: int,
    head_dim: int,
    queries: int,
    keys: int,
    device: str,
    dtype: torch.dtype,
    iters: int = 3,
) -> float:
    """Measured rate of the engine's page backward (``kernels.attention.attention_grads``, dQ dK dV of one page given
    the final out/LSE; cuDNN's where it is verified) at the full mode's segment shape: ``queries`` tokens' grouped
    query heads folded into rows against ``keys`` keys of ``kv_heads`` heads, non-causal. Counted in the floors'
    FLOPs, 8 x query heads x head_dim per q-k pair (dQ, dK, dV: twice the forward's matmuls; the backward's own
    recompute of the scores is not counted), so that a floor taking this rate is the same FLOPs at the kernel's
    speed."""
    rep = query_heads // kv_heads
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, kv_heads, rep * queries, head_dim, device=device, dtype=dtype, generator=gen)
    k, v = (
        torch.randn(1, kv_heads, keys, head_dim, device=device, dtype=dtype, generator=gen) for _ in range(2)
    )
    dout = torch.randn_like(q)
    scale = head_dim**-0.5
    out, lse = attention_lse(q, k, v, scale)

    def f():
        return attention_grads(q, k, v, out, lse, dout, scale)

    f()
    with Timer() as t:
        for _ in range(iters):
            f()
    return 8 * query_heads * head_dim * queries * keys * iters / t.seconds / 1e12


def bandwidth_gbs_at(nbytes: int, device: str, iters: int = 10) -> float:
    """Measured memory bandwidth (bytes read + written per second by a large copy), in GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    with Timer() as t:
        for _ in range(iters):
            dst.copy_(src)
    del src, dst
    return 2 * nbytes * iters / t.seconds / 1e9


def kernel_profiler(record_shapes: bool = False) -> torch.profiler.profile:
    """A torch profiler of CPU ops and, on a GPU, device kernels (``record_shapes``: the ops' input shapes, for
    :func:`top_ops`)."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=acts, record_shapes=record_shapes)


def top_ops(prof: torch.profiler.profile, top: int) -> list[dict]:
    """The ``top`` aten ops of ``prof`` by the device time of the kernels they launched themselves (CPU time on CPU),
    grouped by input shapes where ``prof`` recorded them: which op and shape a device kernel of :func:`top_kernels`
    comes from (a kernel's name alone, e.g. ``FillFunctor<int>``, does not say)."""
    cuda = torch.cuda.is_available()
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        if not e.key.startswith("aten::") or e.device_type != torch.autograd.DeviceType.CPU:
            continue
        self_us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if self_us > 0:
            shapes = str(e.input_shapes)[:160] if e.input_shapes else ""
            rows.append({"op": e.key, "shapes": shapes, "self_s": self_us / 1e6, "calls": e.count})
    rows.sort(key=lambda r: -r["self_s"])
    return rows[:top]


def top_kernels(prof: torch.profiler.profile, top: int) -> list[dict]:
    """The ``top`` device kernels (CPU ops on CPU) of ``prof`` by self time, each with its share of the total."""
    cuda = torch.cuda.is_available()
    rows = []
    for e in prof.key_averages():
        self_us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if self_us > 0 and (not cuda or e.device_type == torch.autograd.DeviceType.CUDA):
            rows.append({"name": e.key[:120], "self_s": self_us / 1e6, "calls": e.count})
    rows.sort(key=lambda r: -r["self_s"])
    total = sum(r["self_s"] for r in rows) or 1.0
    for r in rows:
        r["share"] = r["self_s"] / total
    return rows[:top]


# kernel families by name, first match wins (device kernels of cuBLAS / cuDNN / torch / Triton)
KERNEL_FAMILIES = (
    ("attention", ("sdpa", "fmha", "flash", "attention", "dq_kernel", "dkdv", "_attn")),
    (
        "gdn",
        ("chunk_", "gated_delta", "delta_rule", "conv1d", "fwd_h", "bwd_d", "solve_tril", "dqkwg", "trsm"),
    ),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas", "matmul")),
    ("copy", ("copy", "cat", "index", "scatter", "gather", "memcpy", "memset", "fill")),
    ("norm", ("norm", "rms")),
    ("elementwise", ("elementwise", "reduce", "softmax", "mul", "add", "silu", "sigmoid", "exp")),
)


def kernel_families(prof: torch.profiler.profile) -> dict:
    """Device seconds (CPU seconds on CPU) of ``prof`` by kernel family (:data:`KERNEL_FAMILIES`; ``other``), with
    the kernel count: what a phase spends on GEMMs, attention, the GDN recurrence, copies and small kernels."""
    out: dict[str, dict] = {}
    for row in top_kernels(prof, 10**9):
        name = row["name"].lower()
        family = next((f for f, keys in KERNEL_FAMILIES if any(k in name for k in keys)), "other")
        slot = out.setdefault(family, {"self_s": 0.0, "calls": 0})
        slot["self_s"] += row["self_s"]
        slot["calls"] += row["calls"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["self_s"]))
