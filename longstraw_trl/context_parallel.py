"""Context parallelism over prompt pages: the collectives of one context-parallel group.

Global page ``j`` of every full-attention layer lives on rank ``j % cp_size`` of the CP group; GDN
states, weights and the response are replicated. Every rank runs every prompt chunk and every response;
an attention layer computes ``(out, lse)`` over its own pages, all-gathers the partials and merges them
in rank order (so every rank holds the same result), then adds the causal response part. Backward
needs the page part's dQ only: each rank computes it from its pages and the all-reduce sums it, so
parameter gradients come out identical on every rank (docs/design.md, "Distributed, model-native
ownership").
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def merge_gathered(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of partial attentions over disjoint key sets, in list order, without host sync.

    ``outs[r]`` is ``[..., T, D]`` and ``lses[r]`` ``[..., T]`` (fp32). A partial with ``lse = -inf``
    on a row (no keys: e.g. a rank that holds no pages yet) has weight ``exp(-inf - m) = 0`` there. The
    row maximum ``m`` is replaced by 0 where every partial is empty, so such a row comes out as
    ``out = 0, lse = -inf`` (no NaN). The same inputs in the same order give the same bits on every rank.
    """
    m = lses[0]
    for s in lses[1:]:
        m = torch.maximum(m, s)
    m = m.masked_fill(m == float("-inf"), 0.0)
    total, acc = None, None
    for o, s in zip(outs, lses, strict=True):
        w = torch.exp(s - m)
        wo = w.unsqueeze(-1) * o
        total, acc = (w, wo) if total is None else (total + w, acc + wo)
    lse = m + torch.log(total)  # total = 0 (every partial empty): lse = -inf
    out = acc / total.clamp_min(torch.finfo(total.dtype).tiny).unsqueeze(-1)
    return out, lse


class SingleRank:
    """The communicator of a prompt state without context parallelism: every collective is the identity (the same
    protocol as :class:`ContextParallel`)."""

    rank, size = 0, 1

    @staticmethod
    def reduce_partial(out, lse, q):
        return out, lse

    @staticmethod
    def reduce_dq(dq_pages, dq_self):
        return dq_pages + dq_self

    @staticmethod
    def all_reduce_sum(t):
        return t

    @staticmethod
    def all_gather(t):
        return [t]


def communicator(group) -> SingleRank | ContextParallel:
    """The collectives over a context-parallel ``group`` (``None``: a single rank)."""
    return SingleRank() if group is None else ContextParallel(group)


class ContextParallel:
    """Collectives of one context-parallel group (any backend: NCCL on GPUs, gloo on CPU)."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def reduce_partial(self, out: torch.Tensor | None, lse: torch.Tensor | None, q: torch.Tensor):
        """Exact merge of every rank's prompt-part ``(out, lse)`` (``None``: this rank has no pages).

        Every rank contributes one fp32 tensor ``[B, H, T, D + 1]`` (``out`` with ``lse`` as its last
        column), whatever its pages: partials can be bf16 (CPU autocast) or fp32 (flash-attention's
        LSE, the plain-math path), and a rank without pages sends ``out = 0, lse = -inf``, which
        :func:`merge_gathered` weighs by 0 (the placeholder assumes the value head dim equals the
        query's, as in every supported family). No host sync: nothing here reads a tensor's values.
        """
        if out is None:
            b, h, t, d = q.shape
            part = q.new_zeros((b, h, t, d + 1), dtype=torch.float32)
            part[..., -1] = float("-inf")
        else:
            part = torch.cat([out.float(), lse.float().unsqueeze(-1)], dim=-1)
        parts = [torch.empty_like(part) for _ in range(self.size)]
        dist.all_gather(parts, part, group=self.group)
        return merge_gathered([p[..., :-1] for p in parts], [p[..., -1] for p in parts])

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape on every rank), in rank order."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return parts

    def reduce_dq(self, dq_pages: torch.Tensor, dq_self: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's page dQ plus the response part's dQ (fp32), bit-identical on every rank.

        The response part is computed redundantly on every rank, and GPU attention backward kernels
        accumulate dQ with atomics, so ranks can differ in the last bits: only the first rank's copy
        enters the all-reduce, whose result is the same on all ranks.
        """
        dq = dq_pages.float() + dq_self.float() if self.rank == 0 else dq_pages.float().contiguous()
        dist.all_reduce(dq, group=self.group)
        return dq

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over the group's ranks (a new tensor, the same on every rank)."""
        out = t.contiguous().clone()
        dist.all_reduce(out, group=self.group)
        return out


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
