"""The torch reference of the host-row gather: indices to the host, a CPU gather, one copy over."""

from __future__ import annotations

import torch


def naive_gather_rows(table: torch.Tensor, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``table[rows]`` on ``device`` (``-1``: a zero row), gathered where ``table`` lives: the indices are
    copied to the table's device first (from a GPU, a host sync), the rows gathered there (into pinned memory
    when ``table`` is pinned, so the copy out is asynchronous) and copied to ``device``."""
    idx = rows.to(table.device)
    pinned = table.device.type == "cpu" and table.is_pinned()
    out = torch.empty(
        (idx.numel(), *table.shape[1:]), dtype=table.dtype, device=table.device, pin_memory=pinned
    )
    torch.index_select(table, 0, idx.clamp_min(0), out=out)
    out[idx < 0] = 0
    return out.to(device, non_blocking=True)
