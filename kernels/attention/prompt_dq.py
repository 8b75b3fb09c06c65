"""dQ of queries against read-only prompt keys: a query-parallel Triton kernel (its reference: ``naive_prompt_dq``).

The replay's backward through the prompt pages needs dQ only (the pages are constants). The flash backward op
computes dQ, dK and dV, parallel over key blocks with dQ accumulated by atomic adds: for a replay (a few
thousand query rows against up to millions of prompt keys) that is thousands of atomic adds per dQ element,
and dK/dV of every prompt key, all thrown away. This kernel is parallel over query blocks (and over key splits
when there are few query blocks), keeps its dQ block in registers, and runs three matmuls a key tile:

    s = q k^T,  p = exp(scale * s - lse),  dp = dO v^T,  ds = p * (dp - delta),  dQ += scale * ds k

with ``delta_i = dO_i . O_i`` and ``O``/``lse`` the *final* merged output and log-sum-exp (the FlashAttention
identity: the part's probabilities are exact against the merged normaliser).

Layouts: ``q, dout [H, M, D]`` (grouped query heads folded into rows), ``k, v [H, N, D]`` (any row stride),
``lse, delta [H, M]`` fp32. Returns fp32 ``dq [H, M, D]``.
"""

from __future__ import annotations

import functools

import torch

from ..runtime.autotune import autotune
from ..runtime.switches import kernel_builds


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    configs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bm, bn, w, s in ((64, 64, 8, 2), (64, 32, 4, 2), (128, 32, 8, 2), (64, 64, 4, 3), (32, 64, 4, 2))
    ]

    @autotune(triton, configs, key=["D", "M_BUCKET"])
    @triton.jit
    def dq_kernel(
        Q,
        K,
        V,
        DO,
        LSE,
        DELTA,
        DQ,
        stride_qh,
        stride_qm,
        stride_kh,
        stride_kn,
        stride_vh,
        stride_vn,
        stride_dh,
        stride_dm,
        stride_os,
        stride_oh,
        stride_om,
        M,
        N,
        keys_per_split,
        scale,
        M_BUCKET,
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        pid_m, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        in_m = offs_m < M
        q = tl.load(
            Q + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :], mask=in_m[:, None], other=0.0
        )
        do = tl.load(
            DO + h * stride_dh + offs_m[:, None] * stride_dm + offs_d[None, :], mask=in_m[:, None], other=0.0
        )
        # rows past M get lse = +inf: p = 0, so they add nothing
        log2e = 1.4426950408889634  # exp(x) = exp2(x * log2(e)); a literal: a jit function reads no globals
        lse = tl.load(LSE + h * M + offs_m, mask=in_m, other=float("inf")) * log2e
        delta = tl.load(DELTA + h * M + offs_m, mask=in_m, other=0.0)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        start = split * keys_per_split
        end = tl.minimum(start + keys_per_split, N)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            in_n = offs_n < end
            k = tl.load(
                K + h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
                mask=in_n[:, None],
                other=0.0,
            )
            v = tl.load(
                V + h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :],
                mask=in_n[:, None],
                other=0.0,
            )
            s = tl.dot(q, tl.trans(k))
            p = tl.exp2(s * (scale * log2e) - lse[:, None])
            p = tl.where(in_n[None, :], p, 0.0)
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None])
            acc += tl.dot(ds.to(k.dtype), k)
        acc = acc * scale
        tl.store(
            DQ + split * stride_os + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
            acc,
            mask=in_m[:, None],
        )

    return triton, dq_kernel


def prompt_dq_available(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether :func:`prompt_dq` serves these inputs (CUDA, fp16/bf16, a power-of-two head dim up to 256)."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype):
        return False
    d = q.shape[-1]
    if d not in (16, 32, 64, 128, 256) or k.shape[-1] != d:
        return False
    return kernel_builds(_kernel)


def prompt_dq(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dout: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """fp32 ``dq [H, M, D]`` of ``q [H, M, D]`` over keys ``k, v [H, N, D]`` (see the module docstring)."""
    h, m, d = q.shape
    q, dout = q.contiguous(), dout.to(q.dtype).contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    lse, delta = lse.float().contiguous(), delta.float().contiguous()
    bucket = 1 << max(m - 1, 1).bit_length()  # autotune once per power-of-two row count
    tuned = (q.device, q.dtype, d, bucket)  # what Triton's autotuner keys on (its key, the argument dtypes)
    if tuned not in _TUNED:
        # Triton's autotuner times every config on the call it sees: on a replay's millions of prompt keys that is
        # seconds per config. Tune on the first TUNE_KEYS keys instead (same rows, same tile shapes) and keep it.
        if k.shape[1] > TUNE_KEYS:
            _launch(q, k[:, :TUNE_KEYS], v[:, :TUNE_KEYS], dout, lse, delta, scale, bucket)
        _TUNED.add(tuned)
    return _launch(q, k, v, dout, lse, delta, scale, bucket)


# Keys the autotuner's timing runs see at most (see :func:`prompt_dq`); (device, dtype, head dim, row bucket) tuned so far.
TUNE_KEYS = 1 << 15
_TUNED: set = set()


def _launch(q, k, v, dout, lse, delta, scale, bucket):
    triton, kernel = _kernel()
    h, m, d = q.shape
    n = k.shape[1]
    # enough programs for the GPU: split the keys when the query blocks alone are few
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    blocks = h * triton.cdiv(m, 64)
    splits = max(1, min(triton.cdiv(2 * sms, blocks), triton.cdiv(n, 4096)))
    keys_per_split = triton.cdiv(triton.cdiv(n, splits), 64) * 64
    splits = triton.cdiv(n, keys_per_split)
    out = torch.empty(splits, h, m, d, device=q.device, dtype=torch.float32)

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]), h, splits)

    kernel[grid](
        q,
        k,
        v,
        dout,
        lse,
        delta,
        out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        dout.stride(0),
        dout.stride(1),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        m,
        n,
        keys_per_split,
        float(scale),
        bucket,
        D=d,
    )
    return out[0] if splits == 1 else out.sum(0)
