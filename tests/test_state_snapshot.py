"""The read-only check of tests/_state.py: it compares what the state holds when checked, so a layer whose tensors
were rebound to new ones (how Gated DeltaNet and Mamba-2 states advance) reads as changed."""

from __future__ import annotations

import torch
from _models import build_hybrid
from _state import snapshot, unchanged

from longstraw_trl import ConvRecurrentState, capture_prompt


def _recurrent_layer(state) -> ConvRecurrentState:
    return next(layer for layer in state.layers.values() if isinstance(layer, ConvRecurrentState))


def _captured():
    model = build_hybrid("qwen3_5")
    return capture_prompt(model, torch.randint(0, model.config.vocab_size, (24,)), chunk_size=8, page_size=16)


def test_a_rebound_layer_state_reads_as_changed():
    state = _captured()
    snap = snapshot(state)
    assert unchanged(snap)
    layer = _recurrent_layer(state)
    layer.append(layer.conv, layer.recurrent + 1)  # new tensors; the snapshot's own ones are untouched
    assert not unchanged(snap)


def test_rebinding_to_equal_values_reads_as_unchanged():
    state = _captured()
    snap = snapshot(state)
    layer = _recurrent_layer(state)
    layer.append(layer.conv.clone(), layer.recurrent.clone())
    assert unchanged(snap)


def test_a_write_into_a_layer_state_reads_as_changed():
    state = _captured()
    snap = snapshot(state)
    _recurrent_layer(state).recurrent.add_(1)
    assert not unchanged(snap)
