"""Which backward of a micro-batch synchronises the gradients across processes.

DDP reduces the gradients in the backward of the last micro-batch of an optimizer step, and every other backward of
that micro-batch must run under ``no_sync``. :func:`plan_sync` decides which backward that is (a
:class:`SyncPlan`: plain lists); :class:`GradientSync` turns the plan into the contexts the replays and the
prompt backward run under."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from torch import nn

__all__ = ["GradientSync", "SyncPlan", "plan_sync"]


@dataclass(frozen=True)
class SyncPlan:
    """When the gradients of a micro-batch are synchronised across processes (DDP reduces in the backward of the
    last micro-batch of an optimizer step; every other backward of that micro-batch must run under ``no_sync``).

    Attributes:
        group_order: the order the groups are processed in (the synchronising group last).
        sync_row: the response whose backward synchronises (run last in its group); ``None`` without DDP, and with
            the full gradient, whose last prompt backward synchronises instead.
        ddp: several processes and a backward.
        full: the full gradient.
    """

    group_order: list[int]
    sync_row: int | None
    ddp: bool
    full: bool

    def rows_in_order(self, rows: list[int]) -> list[int]:
        """A group's rows, the synchronising response last."""
        rows = list(rows)
        if self.sync_row in rows:
            rows.remove(self.sync_row)
            rows.append(self.sync_row)
        return rows

    def batch_skips_sync(self, batch: list[int]) -> bool:
        """Whether a replay batch's backward runs under ``no_sync``."""
        return (self.sync_row is not None and self.sync_row not in batch) or (self.full and self.ddp)

    def prompt_backward_syncs(self, group: int) -> bool:
        """Whether a group's prompt backward (the full gradient) ends with the synchronising backward."""
        return self.ddp and group == self.group_order[-1]


def plan_sync(row_group: list[int], lengths: list[int], num_groups: int, ddp: bool, full: bool) -> SyncPlan:
    """The :class:`SyncPlan` of a micro-batch: under DDP the longest response synchronises (its group processed
    last); a process without any loss token still takes part, with its first row's zero-weighted replay."""
    group_order = list(range(num_groups))
    sync_row = None
    if ddp:
        with_tokens = [i for i in range(len(row_group)) if lengths[i] > 0]
        sync_row = max(with_tokens, key=lambda i: lengths[i]) if with_tokens else 0
        group_order.remove(row_group[sync_row])
        group_order.append(row_group[sync_row])
    if full:  # every replay under no_sync; the last group's prompt backward synchronises
        sync_row = None
    return SyncPlan(group_order, sync_row, ddp, full)


class NoSync(Protocol):
    """The one collective :class:`GradientSync` needs (``Collectives.no_sync``)."""

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager: ...


class GradientSync:
    """A :class:`SyncPlan` applied to one model: the context each replay batch's backward runs under, and the
    ``no_sync`` the engine enters around the backwards inside a response's block replay or a prompt backward."""

    def __init__(self, plan: SyncPlan, collectives: NoSync, model: nn.Module):
        self.plan, self.collectives, self.model = plan, collectives, model

    def around_batch(self, batch: list[int]) -> contextlib.AbstractContextManager:
        """Around a replay batch's backward: ``no_sync`` unless it is the synchronising one."""
        if self.plan.batch_skips_sync(batch):
            return self.collectives.no_sync(self.model)
        return contextlib.nullcontext()

    def _no_sync(self) -> contextlib.AbstractContextManager:
        return self.collectives.no_sync(self.model)

    def inside_response(self, row: int) -> Callable[[], contextlib.AbstractContextManager] | None:
        """For the blocks of a reverse block replay: the synchronising response's blocks but its last run under
        ``no_sync`` (``None``: the blocks need no context of their own)."""
        return self._no_sync if row == self.plan.sync_row else None

    def inside_prompt_backward(self) -> Callable[[], contextlib.AbstractContextManager] | None:
        """For the chunks of a prompt backward: under DDP, every chunk's backward but a synchronising last one
        runs under ``no_sync``."""
        return self._no_sync if self.plan.ddp else None

    def prompt_backward_syncs(self, group: int) -> bool:
        """Whether group ``group``'s prompt backward ends with the micro-batch's synchronising backward."""
        return self.plan.prompt_backward_syncs(group)
