"""Bit-exact snapshots of a PromptState (every tensor it holds, unfilled segment room included)."""

from __future__ import annotations

import torch

from longstraw_trl import KVPages, WindowKV


def state_tensors(state) -> list[torch.Tensor]:
    tensors = [state.last_token]
    for layer in state.layers.values():
        if isinstance(layer, KVPages):
            for k, v, _ in layer.segments:
                tensors += [k, v]
        elif isinstance(layer, WindowKV):
            tensors += [layer.k, layer.v]
        else:
            tensors += [layer.conv, layer.recurrent]
    return tensors


def _bits(t: torch.Tensor) -> torch.Tensor:
    # compare raw bytes: unfilled segment room is uninitialised memory and may hold NaN patterns
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def snapshot(state):
    live = state_tensors(state)
    return [_bits(t).clone() for t in live], live


def unchanged(snap) -> bool:
    before, live = snap
    return all(torch.equal(a, _bits(b)) for a, b in zip(before, live, strict=True))
