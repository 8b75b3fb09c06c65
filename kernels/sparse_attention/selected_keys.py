"""Attention over each query's chosen rows of a key table, graph-free: a fused Triton kernel.

    out[b, h, t] = sum_j softmax_j(scale * q[b, h, t] . K[r_j]) V[r_j],   r_j = rows[b, t, j] (-1: no key)

with ``K[r] = table[(b,) r, :]`` and ``V[r] = table[(b,) r, :value_dim]`` (MLA in latent space: key
``[c_kv | k_rot]``, value ``c_kv``), and ``lse[b, h, t]`` (``-inf``, with ``out = 0``, for a query with no key).
The torch reference is :func:`kernels.sparse_attention.dsa.selected_attention_block`, which gathers every query's
rows into memory (``[rows, k, D]``) before two batched GEMMs and an fp32 softmax: on the H200 that gather, its
copies and the masking were most of a GLM-5 slice's capture (``bench/results/profile_glm-5-3L_h200_P65536_capture.txt``).

The kernel runs one program per (query, block of heads): the heads are the GEMM rows (MLA has one key head,
so every head of a query reads the same rows), the chosen rows are loaded through their indices a block at a
time, and an online softmax keeps the running max, sum and output in registers; nothing of the gather is
written. It rounds where the reference does, so on half inputs the two differ only by accumulation order:
scores are rounded to the inputs' dtype before the scale (as the reference's half GEMM output), and the
probabilities to the table's dtype before they multiply the values.

Layouts: ``q [B, H, T, D]``, ``table [N, D]`` (shared by the batch) or ``[B, N, D]``, ``rows [B, T, k]`` (any
integer dtype), each with a contiguous last dim. No autograd: the callers use it where no graph is built
(capture, decoding, old / reference log-probs, and the forward of the prompt part, whose backward is dQ
only). ``LONGSTRAW_DISABLE=selected_attention_kernel`` takes the torch path (for comparison).
"""

from __future__ import annotations

import functools
import os

import torch

from ..runtime.switches import enabled, kernel_builds

SWITCH = "selected_attention_kernel"
# (heads a program holds at most, chosen rows loaded an iteration, warps, stages). The program's fp32 output,
# heads x value dim, sits in registers. The first is the default: on the H200 at GLM-5's sizes (1M keys,
# top-2,048; a sweep of these tiles at rev 9303606) it
# took 1.9-2.3x less time than the default before it, (32, 32, 8, 2), and least of all six: all 64 heads of a
# query in one program, so its rows are read once and the dots have M = 64 for wgmma. The others are those the sweep compared.
TILES = ((64, 64, 8, 2), (32, 32, 8, 2), (64, 32, 8, 2), (64, 32, 16, 2), (32, 64, 8, 3), (16, 64, 4, 2))
# Under Triton's CPU interpreter (which cannot loop to a run-time bound under NumPy 2.4) the loop over a query's
# chosen rows runs to the row count rounded up to this, a compile-time bound; compiled, it runs to the row
# count itself, so a capture, which compacts every chunk's rows to a new width, compiles the kernel once.
K_ROUND = 128
# Fewer (batch x query) rows than this take the torch path: one program per query and head block would leave
# most of the GPU idle (a decode step's G queries); the reference batches them into GEMMs instead.
MIN_QUERY_ROWS = 64


def _pow2(n: int, at_least: int = 16) -> int:
    return max(at_least, 1 << max(n - 1, 0).bit_length())


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    # sizes, and the strides that follow them, are not specialised (divisible by 16 or not): every capture
    # chunk's compacted width k and every prompt length is new (a capture's last chunk has one row less)
    @triton.jit(
        do_not_specialize=[
            "T",
            "H",
            "K",
            "stride_qb",
            "stride_rb",
            "stride_rt",
            "stride_ob",
            "stride_lb",
            "stride_lh",
        ]
    )
    def selected_attention_kernel(
        Q,
        TAB,
        ROWS,
        OUT,
        LSE,
        stride_qb,
        stride_qh,
        stride_qt,
        stride_tb,
        stride_tn,
        stride_rb,
        stride_rt,
        stride_ob,
        stride_oh,
        stride_ot,
        stride_lb,
        stride_lh,
        T,
        H,
        K,
        scale,
        K_PAD: tl.constexpr,
        DV: tl.constexpr,
        DR: tl.constexpr,
        ROUND_SCORES: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        BLOCK_DR: tl.constexpr,
    ):
        pid_r, pid_h = tl.program_id(0), tl.program_id(1)
        b = (pid_r // T).to(tl.int64)
        t = (pid_r % T).to(tl.int64)
        offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        in_h = offs_h < H
        offs_v = tl.arange(0, BLOCK_DV)
        in_v = offs_v < DV
        offs_e = tl.arange(0, BLOCK_DR)
        in_e = offs_e < DR
        q_rows = Q + b * stride_qb + t * stride_qt + offs_h.to(tl.int64)[:, None] * stride_qh
        qv = tl.load(q_rows + offs_v[None, :], mask=in_h[:, None] & in_v[None, :], other=0.0)
        qe = tl.load(q_rows + DV + offs_e[None, :], mask=in_h[:, None] & in_e[None, :], other=0.0)
        tab = TAB + b * stride_tb
        row_ptr = ROWS + b * stride_rb + t * stride_rt
        # (tl.full, not tl.zeros: see kernels/sparse_attention/indexer.py, Triton's CPU interpreter)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        total = tl.full([BLOCK_H], 0.0, tl.float32)
        acc = tl.full([BLOCK_H, BLOCK_DV], 0.0, tl.float32)
        for n0 in range(0, K_PAD if K_PAD > 0 else K, BLOCK_N):  # (K_PAD: the interpreter's bound)
            offs_n = n0 + tl.arange(0, BLOCK_N)
            r = tl.load(row_ptr + offs_n, mask=offs_n < K, other=-1)
            valid = r >= 0
            at = tab + tl.where(valid, r, 0).to(tl.int64)[:, None] * stride_tn
            kv = tl.load(at + offs_v[None, :], mask=valid[:, None] & in_v[None, :], other=0.0)
            ke = tl.load(at + DV + offs_e[None, :], mask=valid[:, None] & in_e[None, :], other=0.0)
            s = tl.dot(qv, tl.trans(kv)) + tl.dot(qe, tl.trans(ke))
            if ROUND_SCORES:  # the reference's half GEMM rounds its output
                s = s.to(Q.dtype.element_ty).to(tl.float32)
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            total = total * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
            m = m_new
        has = total > 0.0
        out = acc / tl.where(has, total, 1.0)[:, None]
        lse = tl.where(has, m + tl.log(tl.where(has, total, 1.0)), float("-inf"))
        o_rows = OUT + b * stride_ob + t * stride_ot + offs_h.to(tl.int64)[:, None] * stride_oh
        tl.store(o_rows + offs_v[None, :], out, mask=in_h[:, None] & in_v[None, :])
        tl.store(LSE + b * stride_lb + t + offs_h.to(tl.int64) * stride_lh, lse, mask=in_h)

    return triton, selected_attention_kernel


def selected_attention_kernel_available(q: torch.Tensor, table: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether :func:`selected_attention_kernel` serves these inputs: CUDA, no graph to build, fp16/bf16 ``q``
    and ``table`` of one dtype (an fp32 ``tl.dot`` would round its inputs to tf32), at least
    :data:`MIN_QUERY_ROWS` (batch x query) rows, Triton importable, and
    ``selected_attention_kernel`` not in ``LONGSTRAW_DISABLE``."""
    if not (q.is_cuda and table.is_cuda and q.dtype == table.dtype):
        return False
    if torch.is_grad_enabled() and (q.requires_grad or table.requires_grad):
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or not enabled(SWITCH):
        return False
    if rows.shape[0] * rows.shape[1] < MIN_QUERY_ROWS:
        return False
    return kernel_builds(_kernel)


def selected_attention_kernel(
    q: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
    value_dim: int,
    tile: tuple[int, int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, H, T, value_dim], lse [B, H, T])``, fp32, of ``q [B, H, T, D]`` over its chosen rows
    ``rows [B, T, k]`` of ``table [N, D]`` or ``[B, N, D]`` (see the module docstring). ``tile``: one of
    :data:`TILES` instead of the default (tests and the probe)."""
    if tile is not None and tuple(tile) not in TILES:
        raise ValueError(f"tile {tile} is none of the kernel's tiles {TILES}")
    max_h, block_n, warps, stages = tile or TILES[0]
    b, h, t, d = q.shape
    if table.dim() not in (2, 3) or table.shape[-1] != d or (table.dim() == 3 and table.shape[0] != b):
        raise ValueError(
            f"table {tuple(table.shape)} must be [N, {d}] or [{b}, N, {d}] for q {tuple(q.shape)}"
        )
    if rows.dim() != 3 or tuple(rows.shape[:2]) != (b, t):
        raise ValueError(f"rows {tuple(rows.shape)} must be [{b}, {t}, k] for q {tuple(q.shape)}")
    if not 0 < value_dim <= d:
        raise ValueError(f"value_dim {value_dim} must be in 1..{d} (the key's leading columns)")
    out = torch.zeros(b, h, t, value_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, t), float("-inf"), dtype=torch.float32, device=q.device)
    k, n = rows.shape[-1], table.shape[-2]
    if b * t == 0 or h == 0 or k == 0 or n == 0:  # (no table rows: every row is -1)
        return out, lse
    triton, kernel = _kernel()
    q = q if q.stride(-1) == 1 else q.contiguous()
    table = table if table.stride(-1) == 1 else table.contiguous()
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    block_h = min(max_h, _pow2(h))
    block_dv = _pow2(value_dim)
    grid = (b * t, triton.cdiv(h, block_h))
    kernel[grid](
        q,
        table,
        rows,
        out,
        lse,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        table.stride(0) if table.dim() == 3 else 0,
        table.stride(-2),
        rows.stride(0),
        rows.stride(1),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        lse.stride(0),
        lse.stride(1),
        t,
        h,
        k,
        float(scale),
        K_PAD=triton.cdiv(k, K_ROUND) * K_ROUND if os.environ.get("TRITON_INTERPRET") == "1" else 0,
        DV=value_dim,
        DR=d - value_dim,
        ROUND_SCORES=q.dtype in (torch.float16, torch.bfloat16),
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_DV=block_dv,
        BLOCK_DR=_pow2(d - value_dim),
        num_warps=warps if block_dv >= 256 else min(warps, 4),
        num_stages=stages,
    )
    return out, lse
