"""The rows of a micro-batch, as the streamed loss sees them: each row's group and loss length
(:class:`MicroBatchRows`), which of a group's rows are replayed and in which batches (:func:`plan_group_replays`,
:func:`replay_batches`), and how a generation batch is cut into micro-batches (:func:`split_by_groups`).

Plain lists and integers: nothing here runs a model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .errors import LongStrawError
from .loss import loss_lengths

__all__ = [
    "GroupReplays",
    "MicroBatchRows",
    "plan_group_replays",
    "replay_batches",
    "split_by_groups",
]


@dataclass(frozen=True)
class MicroBatchRows:
    """Which prompt group each row of a micro-batch belongs to, each group's rows, and each row's loss mask and
    length.

    Attributes:
        row_group: per row, the index of its prompt in ``inputs["longstraw_prompts"]``.
        rows_of: per group, its rows in order.
        loss_mask: ``completion_mask``, times ``tool_mask`` when present (TRL's loss mask).
        lengths: per row, its last loss position + 1 (0 without loss tokens).
    """

    row_group: list[int]
    rows_of: list[list[int]]
    loss_mask: torch.Tensor
    lengths: tuple[int, ...]

    @classmethod
    def of(cls, inputs: dict[str, Any]) -> MicroBatchRows:
        """The rows of a micro-batch's inputs (without ``longstraw_row_group``: whole groups, in order)."""
        completion_mask = inputs["completion_mask"]
        loss_mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        num_groups = len(inputs["longstraw_prompts"])
        num_rows = inputs["completion_ids"].size(0)
        row_group = inputs.get("longstraw_row_group")
        if row_group is None:  # whole groups, in order
            row_group = torch.arange(num_rows) // (num_rows // num_groups)
        row_group = row_group.tolist()
        rows_of = [[i for i in range(num_rows) if row_group[i] == g] for g in range(num_groups)]
        return cls(row_group, rows_of, loss_mask, loss_lengths(loss_mask))

    @property
    def num_groups(self) -> int:
        return len(self.rows_of)


@dataclass(frozen=True)
class GroupReplays:
    """How one group's rows are replayed.

    Attributes:
        skipped: rows without a loss token that are not replayed (their term is exactly zero), in order.
        batches: the replayed rows, cut into the batches replayed (and back-propagated) together.
        lengths: the positions each replayed row replays.
    """

    skipped: list[int]
    batches: list[list[int]]
    lengths: dict[int, int]


def plan_group_replays(
    rows: list[int],
    lengths: tuple[int, ...] | list[int],
    sync_row: int | None,
    width: int,
    budget: int,
    one_at_a_time: bool,
    replay_empty: bool,
) -> GroupReplays:
    """A group's :class:`GroupReplays`. ``rows``: the group's rows in the order they run (the synchronising one
    last); ``lengths``: every row's loss length; ``width``: the micro-batch's padded length.

    A row without a loss token is skipped (TRL's sums multiply its terms by the mask), unless it is the
    synchronising row, or ``replay_empty`` (the router auxiliary loss: it still routes its prompt). The
    synchronising row replays at least 2 positions: a 1-token replay skips the decoder layers, whose parameters
    DDP expects."""
    skipped, replayed = [], []
    for i in rows:
        if lengths[i] == 0 and i != sync_row and not replay_empty:
            skipped.append(i)
        else:
            replayed.append(i)
    replay_length = {i: max(lengths[i], min(2, width)) if i == sync_row else lengths[i] for i in replayed}
    return GroupReplays(
        skipped, replay_batches(replayed, replay_length, budget, one_at_a_time), replay_length
    )


def replay_batches(
    rows: list[int], lengths: dict[int, int], budget: int, one_at_a_time: bool
) -> list[list[int]]:
    """``rows`` (of one prompt group, in order; ``lengths``: the positions each replays) cut into the batches replayed
    together under autograd: consecutive rows while the batch's padded tokens (rows x longest) stay within
    ``budget``. One row a batch when ``budget`` is 0 or with ``one_at_a_time`` (the router auxiliary loss, whose
    replays run one position longer; reverse block replay, back-propagated block by block)."""
    if one_at_a_time or budget <= 0:
        return [[i] for i in rows]
    batches: list[list[int]] = []
    longest = 0
    for i in rows:
        length = lengths[i]
        if batches and (len(batches[-1]) + 1) * max(longest, length) <= budget:
            batches[-1].append(i)
            longest = max(longest, length)
        else:
            batches.append([i])
            longest = length
    return batches


def split_by_groups(
    batch: dict[str, Any], num_chunks: int, order: list[int] | None = None
) -> list[dict[str, Any]]:
    """Split a generation batch's rows into ``num_chunks`` micro-batches, its groups taken in ``order`` (default: a
    random permutation, as TRL shuffles the rows of a generation batch).

    A micro-batch holds the prompts of the groups it has rows of (``longstraw_prompts``) and, per row, the index of
    its prompt among them (``longstraw_row_group``); a group cut by a micro-batch boundary is replayed from the same
    cached state in both micro-batches."""
    prompts = batch["longstraw_prompts"]
    rows = batch["completion_ids"].size(0)
    size = rows // len(prompts)
    if rows % num_chunks != 0:
        raise LongStrawError(
            f"a generation batch of {rows} completions cannot be split into {num_chunks} equal micro-batches"
        )
    if order is None:
        order = torch.randperm(len(prompts)).tolist()
    row_order = torch.cat([torch.arange(g * size, (g + 1) * size) for g in order])
    per_chunk = rows // num_chunks
    chunks = []
    for c in range(num_chunks):
        index = row_order[c * per_chunk : (c + 1) * per_chunk]
        row_groups = (index // size).tolist()
        group_ids = list(dict.fromkeys(row_groups))  # in order of appearance
        position = {g: j for j, g in enumerate(group_ids)}
        chunk = {}
        for name, value in batch.items():
            if name == "longstraw_prompts":
                chunk[name] = [prompts[g] for g in group_ids]
            elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.size(0) == rows:
                chunk[name] = value[index.to(value.device)]
            else:
                chunk[name] = value
        chunk["longstraw_row_group"] = torch.tensor([position[g] for g in row_groups])
        chunks.append(chunk)
    return chunks
