"""Chosen rows of a pinned host table gathered by the GPU itself: a Triton kernel, and its torch reference.

    out[i, :] = table[rows[i], :]        (table in pinned host memory, rows and out on the GPU)

A decode step of an offloaded GLM-5 state needs, per layer, the latent rows its G queries chose (G x top-k of
them, 1,152 B each), out of a table of a million rows that stays in host memory. The torch path
(:func:`naive_gather_rows`) must bring the indices to the host first (a host sync every full indexer
layer), gather there with the CPU and copy the result over. On CUDA, pinned host memory is mapped into the
device's address space (unified virtual addressing), so a kernel can read the rows where they are: each
program loads one index and copies its row over PCIe into device memory, ordered on the compute stream like
any kernel. No host sync and no staging buffer, so a decode step can stay one CUDA graph.

Layouts: ``table [N, D]`` with a contiguous last dim (pinned host memory, or any memory the GPU can address),
``rows [M]`` integer on the GPU (``-1``: a zero row). ``LONGSTRAW_DISABLE=host_gather_kernel`` takes the torch path
(for comparison).
"""

from __future__ import annotations

import functools

import torch

from ..runtime.switches import enabled, kernel_builds

SWITCH = "host_gather_kernel"
# a row's columns a program copies at once (GLM-5's latent row, 576 wide, is one block of 1,024, masked)
MAX_BLOCK_D = 1024
# (rows a program copies, warps): the first is the default; a sweep at rev 6571788 compared them all
# (more rows a program: more reads over PCIe in flight per program)
TILES = ((1, 4), (4, 4), (8, 8), (16, 8), (32, 8))


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M", "D", "stride_t", "stride_o"])
    def gather_rows_kernel(
        TAB, ROWS, OUT, M, D, stride_t, stride_o, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr
    ):
        offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        in_r = offs_r < M
        r = tl.load(ROWS + offs_r, mask=in_r, other=-1).to(tl.int64)
        keep = r >= 0
        cols = offs[None, :] < D
        src = TAB + tl.where(keep, r, 0)[:, None] * stride_t + offs[None, :]
        vals = tl.load(src, mask=keep[:, None] & cols, other=0.0)
        tl.store(
            OUT + offs_r.to(tl.int64)[:, None] * stride_o + offs[None, :], vals, mask=in_r[:, None] & cols
        )

    return triton, gather_rows_kernel


def gather_rows_kernel_available(table: torch.Tensor, rows: torch.Tensor, device: torch.device) -> bool:
    """Whether :func:`gather_rows_kernel` serves: ``rows`` and ``device`` CUDA, ``table`` pinned host memory
    (or on that device) with a contiguous last dim, Triton importable, ``host_gather_kernel`` not in
    ``LONGSTRAW_DISABLE``."""
    if device.type != "cuda" or not rows.is_cuda or table.dim() != 2 or table.stride(-1) != 1:
        return False
    if not (table.is_cuda or table.is_pinned()):  # pageable host memory is not mapped into the GPU
        return False
    return enabled(SWITCH) and kernel_builds(_kernel)


def gather_rows_kernel(
    table: torch.Tensor,
    rows: torch.Tensor,
    device: torch.device | None = None,
    tile: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``table[rows]`` (``-1``: a zero row) written on ``device`` (default: ``rows``' device) by a kernel that
    reads ``table`` where it lives (see the module docstring). ``tile``: one of :data:`TILES` instead of the
    default (tests and the probe)."""
    if table.dim() != 2 or table.stride(-1) != 1:
        raise ValueError(f"table {tuple(table.shape)} must be 2-D with a contiguous last dim")
    if rows.dim() != 1:
        raise ValueError(f"rows {tuple(rows.shape)} must be 1-D")
    if tile is not None and tuple(tile) not in TILES:
        raise ValueError(f"tile {tile} is none of the kernel's tiles {TILES}")
    block_r, warps = tile or TILES[0]
    device = rows.device if device is None else torch.device(device)
    n, d = rows.numel(), table.shape[1]
    out = torch.empty(n, d, dtype=table.dtype, device=device)
    if n == 0 or d == 0:
        return out
    triton, kernel = _kernel()
    block_d = min(MAX_BLOCK_D, triton.next_power_of_2(d))
    grid = (triton.cdiv(n, block_r), triton.cdiv(d, block_d))
    kernel[grid](
        table,
        rows,
        out,
        n,
        d,
        table.stride(0),
        out.stride(0),
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=warps,
    )
    return out
