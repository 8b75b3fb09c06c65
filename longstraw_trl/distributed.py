"""Context parallelism over prompt pages.

Global page ``j`` of every full-attention layer lives on rank ``j % cp_size`` of the CP group; GDN
states, weights and the response are replicated. Every rank runs every prompt chunk and every response;
an attention layer computes ``(out, lse)`` over its own pages, all-gathers the partials and merges them
in rank order (so every rank holds the same result), then adds the causal response part. Backward
needs the page part's dQ only: each rank computes it from its pages and the all-reduce sums it, so
parameter gradients come out identical on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from longstraw_trl.kernels.attention import merge_partials


class ContextParallel:
    """Collectives of one context-parallel group (any backend: NCCL on GPUs, gloo on CPU)."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def reduce_partial(self, out: torch.Tensor | None, lse: torch.Tensor | None, q: torch.Tensor):
        """Exact merge of every rank's prompt-part ``(out, lse)`` (``None``: this rank has no pages)."""
        if out is None:
            b, h, t, d = q.shape
            out = q.new_zeros((b, h, t, d), dtype=torch.float32)
            lse = q.new_full((b, h, t), float("-inf"), dtype=torch.float32)
        outs = [torch.empty_like(out) for _ in range(self.size)]
        lses = [torch.empty_like(lse) for _ in range(self.size)]
        dist.all_gather(outs, out.contiguous(), group=self.group)
        dist.all_gather(lses, lse.contiguous(), group=self.group)
        merged_out, merged_lse = None, None
        for o, s in zip(outs, lses, strict=True):
            if torch.isinf(s).all():  # that rank holds no pages yet (every page has >= 1 key)
                continue
            merged_out, merged_lse = merge_partials(merged_out, merged_lse, o, s)
        return merged_out, merged_lse

    def reduce_dq(self, dq_pages: torch.Tensor, dq_self: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's page dQ plus the response part's dQ, bit-identical on every rank.

        The response part is computed redundantly on every rank, and GPU attention backward kernels
        accumulate dQ with atomics, so ranks can differ in the last bits: only the first rank's copy
        enters the all-reduce, whose result is the same on all ranks.
        """
        dq = dq_pages + dq_self if self.rank == 0 else dq_pages.contiguous()
        dist.all_reduce(dq, group=self.group)
        return dq


def new_cp_groups(cp_size: int):
    """Split the world into consecutive groups of ``cp_size`` ranks; returns this rank's group.

    Every rank must call this (``new_group`` is collective). With ``cp_size == 1`` returns ``None``.
    """
    if cp_size == 1:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % cp_size:
        raise ValueError(f"world size {world} is not a multiple of cp_size {cp_size}")
    mine = None
    for start in range(0, world, cp_size):
        group = dist.new_group(list(range(start, start + cp_size)))
        if start <= rank < start + cp_size:
            mine = group
    return mine
