"""DSA indexer scores: a fused Triton kernel, and its plain torch reference.

    out[b, t, l] = sum_h w[b, t, h] * scale * relu(q[b, t, h, :] . k[b or 0, l, :])

HF's ``GlmMoeDsaIndexer`` computes this as an fp32 ``[B, T, H, L]`` score tensor, a ReLU, and a weighted sum
over the heads: at a capture chunk that is 32 fp32 intermediates written and read per output score, so the
torch path (:func:`naive_index_scores`) is bound by memory traffic. The kernel tiles queries x keys, keeps
the key tile in registers while it loops over the heads (a ``tl.dot`` of bf16 inputs with fp32 accumulation
per head; the ReLU and the weighted head sum in registers) and writes each score once, optionally with the
causal mask of :func:`kernels.sparse_attention.indexer_topk` (``key_pos > q_pos`` -> ``-inf``) fused, into
any ``[B, T, L]`` view whose last dim is contiguous (a slice of a preallocated top-k buffer).

Layouts: ``q [B, T, H, D]`` (half), ``weights [B, T, H]`` (fp32), ``keys [B or 1, L, D]`` (same dtype as
``q``; ``1``: shared by the batch, whose rows are then tiled together), any strides but a contiguous last
dim. ``LONGSTRAW_DISABLE=indexer_kernel`` takes the torch path (for comparison).
"""

from __future__ import annotations

import functools
import os

import torch

from ..runtime.autotune import autotune
from ..runtime.switches import enabled, kernel_builds
from .naive import naive_index_scores

SWITCH = "indexer_kernel"


# (BLOCK_T, BLOCK_L, warps, stages). The key tile (BLOCK_L x D) sits in shared memory for all the heads, the
# query tile of each head streams through it (``stages`` deep, async copies), the fp32 accumulator stays in
# registers. Compiled for sm_90 (Triton 3.6, offline): wgmma, 158-176 registers and no spills, 112-128 KiB of
# shared memory (a buffer row of ragged width, whose stores cannot be vectorised: 255 registers, 48 B spilled
# at 128 x 128). The query tile is re-read per key tile (from L2): 64 B per score at 128 x 128, 32 at 64 x 256.
_LARGE = ((128, 128, 8, 3), (64, 256, 8, 3))
# a few rows (decoding: G queries, a short last query block): the one config for their count, not timed
_SMALL = {16: (16, 128, 4, 3), 32: (32, 128, 4, 3), 64: (64, 128, 4, 3)}
_CONFIGS = {c[:2]: c for c in (*_LARGE, *_SMALL.values())}


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    # sizes are not specialised (divisible by 16 or not): each new key range or query block would compile again
    @triton.jit(do_not_specialize=["T", "ROWS", "L", "ROWS_BUCKET"])
    def scores_kernel(
        Q,
        W,
        K,
        OUT,
        QPOS,
        KPOS,
        stride_qb,
        stride_qt,
        stride_qh,
        stride_wb,
        stride_wt,
        stride_wh,
        stride_kb,
        stride_kl,
        stride_ob,
        stride_ot,
        T,
        ROWS,
        L,
        scale,
        ROWS_BUCKET,
        H: tl.constexpr,
        D: tl.constexpr,
        HAS_MASK: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_L: tl.constexpr,
    ):
        pid_l, pid_t, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        # rows: (batch, query) pairs; keys shared by the batch tile the whole batch together (grid z = 1),
        # per-sequence keys tile one sequence's queries (grid z = B, ROWS = T)
        offs_r = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        in_r = offs_r < ROWS
        rb = (pid_b + offs_r // T).to(tl.int64)
        rt = (offs_r % T).to(tl.int64)
        offs_l = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
        in_l = offs_l < L
        offs_d = tl.arange(0, D)
        # int64 offsets: a [T, L] score view of a 2M-key prompt passes 2^31 elements
        k = tl.load(
            K + pid_b.to(tl.int64) * stride_kb + offs_l.to(tl.int64)[:, None] * stride_kl + offs_d[None, :],
            mask=in_l[:, None],
            other=0.0,
        )
        q_rows = Q + rb * stride_qb + rt * stride_qt
        w_rows = W + rb * stride_wb + rt * stride_wt
        # (tl.full, not tl.zeros: a @jit function of Triton's library, built when triton was imported, which
        # Triton's CPU interpreter cannot call when switched on after that, as the tests do)
        acc = tl.full([BLOCK_T, BLOCK_L], 0.0, tl.float32)
        # (every tile runs all heads: skipping the fully masked ones would save under 2% of a capture)
        for h in range(0, H):
            q = tl.load(q_rows[:, None] + h * stride_qh + offs_d[None, :], mask=in_r[:, None], other=0.0)
            w = tl.load(w_rows + h * stride_wh, mask=in_r, other=0.0)
            s = tl.dot(q, tl.trans(k))
            acc += tl.maximum(s, 0.0) * w[:, None]
        acc = acc * scale
        if HAS_MASK:
            qp = tl.load(QPOS + rt, mask=in_r, other=0)
            kp = tl.load(KPOS + offs_l, mask=in_l, other=0)
            acc = tl.where(kp[None, :] > qp[:, None], float("-inf"), acc)
        tl.store(
            OUT + (rb * stride_ob + rt * stride_ot)[:, None] + offs_l[None, :],
            acc,
            mask=in_r[:, None] & in_l[None, :],
        )

    configs = [
        triton.Config({"BLOCK_T": bt, "BLOCK_L": bl}, num_warps=w, num_stages=s) for bt, bl, w, s in _LARGE
    ]
    tuned = autotune(triton, configs, key=["D", "ROWS_BUCKET", "HAS_MASK"])(scores_kernel)
    return triton, tuned, scores_kernel


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _use_kernel() -> bool:
    return enabled(SWITCH)


def index_scores_kernel_available(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether :func:`index_scores_kernel` serves these inputs: CUDA, fp16/bf16 queries and keys of one dtype,
    a power-of-two head dim from 16 to 256, Triton importable, and ``indexer_kernel`` not in ``LONGSTRAW_DISABLE``."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and keys.dtype == q.dtype):
        return False
    if not _use_kernel() or q.shape[-1] not in (16, 32, 64, 128, 256) or keys.shape[-1] != q.shape[-1]:
        return False
    return kernel_builds(_kernel)


def _check(q, weights, keys, scale, out, q_pos, key_pos) -> None:
    b, t, h, d = q.shape
    n = keys.shape[-2]
    if weights.shape != (b, t, h):
        raise ValueError(
            f"weights {tuple(weights.shape)} do not match q {tuple(q.shape)}: expected {(b, t, h)}"
        )
    if keys.dim() != 3 or keys.shape[0] not in (1, b) or keys.shape[-1] != d:
        raise ValueError(f"keys {tuple(keys.shape)} must be [1 or {b}, L, {d}] for q {tuple(q.shape)}")
    if not scale > 0:
        raise ValueError(f"scale must be positive (relu(scale * s) = scale * relu(s)), got {scale}")
    if out is not None and (tuple(out.shape) != (b, t, n) or out.dtype != torch.float32):
        raise ValueError(f"out must be fp32 [{b}, {t}, {n}], got {out.dtype} {tuple(out.shape)}")
    if (q_pos is None) != (key_pos is None):
        raise ValueError("give both q_pos and key_pos (the causal mask) or neither")
    if q_pos is not None and (q_pos.shape != (t,) or key_pos.shape != (n,)):
        raise ValueError(f"q_pos {tuple(q_pos.shape)} / key_pos {tuple(key_pos.shape)} must be [{t}] / [{n}]")


def index_scores_kernel(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    q_pos: torch.Tensor | None = None,
    key_pos: torch.Tensor | None = None,
    tile: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The Triton kernel (see the module docstring); ``out``: where to write (an fp32 ``[B, T, L]`` view with a
    contiguous last dim; allocated if ``None``); ``q_pos [T]``, ``key_pos [L]``: ``-inf`` where
    ``key_pos > q_pos``. ``tile``: ``(BLOCK_T, BLOCK_L)`` of one of the configs instead of the usual choice: the
    tuned one of the two large tiles (timed once per power-of-two row count, mask or not), or for up to 64 rows
    the one small tile that fits (not timed; also the choice under Triton's CPU interpreter, which cannot time
    configs). Returns ``out``."""
    _check(q, weights, keys, scale, out, q_pos, key_pos)
    triton, tuned, plain = _kernel()
    b, t, h, d = q.shape
    n = keys.shape[-2]
    if out is None:
        out = torch.empty(b, t, n, dtype=torch.float32, device=q.device)
    if out.stride(-1) != 1:
        raise ValueError("out must have a contiguous last dim (a slice of the keys' columns of a buffer)")
    if b == 0 or t == 0 or n == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    weights = weights.float()
    mask = q_pos is not None
    if mask:
        q_pos = q_pos.to(device=q.device, dtype=torch.int64).contiguous()
        key_pos = key_pos.to(device=q.device, dtype=torch.int64).contiguous()
    else:  # (unread)
        q_pos = key_pos = out
    shared = keys.shape[0] == 1
    rows = b * t if shared else t

    rows_bucket = 1 << max(rows - 1, 1).bit_length()  # autotune once per power-of-two row count
    if tile is None and (rows_bucket <= 64 or _interpreted()):
        tile = _SMALL.get(max(16, rows_bucket), _LARGE[0])[:2]
    kernel, meta = tuned, {}
    if tile is not None:
        if tuple(tile) not in _CONFIGS:
            raise ValueError(f"tile {tile} is none of the kernel's configs {sorted(_CONFIGS)}")
        bt, bl, warps, stages = _CONFIGS[tuple(tile)]
        kernel, meta = plain, dict(BLOCK_T=bt, BLOCK_L=bl, num_warps=warps, num_stages=stages)

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_L"]), triton.cdiv(rows, meta["BLOCK_T"]), 1 if shared else b)

    kernel[grid](
        q,
        weights,
        keys,
        out,
        q_pos,
        key_pos,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        weights.stride(0),
        weights.stride(1),
        weights.stride(2),
        keys.stride(0),
        keys.stride(1),
        out.stride(0),
        out.stride(1),
        t,
        rows,
        n,
        float(scale),
        rows_bucket,
        H=h,
        D=d,
        HAS_MASK=mask,
        **meta,
    )
    return out


def index_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    q_pos: torch.Tensor | None = None,
    key_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 ``[B, T, L]`` indexer scores of ``q [B, T, H, D]`` (head weights ``weights [B, T, H]``) against
    ``keys [B or 1, L, D]``, written into ``out`` if given, ``-inf`` where ``key_pos [L] > q_pos [T]`` if
    given: the Triton kernel where it serves the inputs (:func:`index_scores_kernel_available`), else the torch
    reference (:func:`naive_index_scores`, which materialises ``[B, T, H, L]`` fp32 scores: the caller
    tiles the keys)."""
    if index_scores_kernel_available(q, keys):
        return index_scores_kernel(q, weights, keys, scale, out, q_pos, key_pos)
    _check(q, weights, keys, scale, out, q_pos, key_pos)
    s = naive_index_scores(q, weights, keys, scale)
    if out is None:
        out = s
    else:
        out.copy_(s)
    if q_pos is not None:
        out.masked_fill_(key_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return out
