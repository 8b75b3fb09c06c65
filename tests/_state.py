"""Bit-exact snapshots of a PromptState (every tensor it holds, page slack included)."""

from __future__ import annotations

import torch

from longstraw_trl import KVPages


def state_tensors(state) -> list[torch.Tensor]:
    tensors = [state.last_hidden]
    for layer in state.layers.values():
        if isinstance(layer, KVPages):
            for k, v in layer.pages.values():
                tensors += [k, v]
        else:
            tensors += [layer.conv, layer.recurrent]
    return tensors


def _bits(t: torch.Tensor) -> torch.Tensor:
    # compare raw bytes: unfilled page slack is uninitialised memory and may hold NaN patterns
    return t.detach().contiguous().view(torch.uint8)


def snapshot(state):
    live = state_tensors(state)
    return [_bits(t).clone() for t in live], live


def unchanged(snap) -> bool:
    before, live = snap
    return all(torch.equal(a, _bits(b)) for a, b in zip(before, live, strict=True))
