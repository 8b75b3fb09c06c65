"""Bit-exact snapshots of a PromptState (every tensor it holds, unfilled segment room included)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from longstraw_trl import KVPages, WindowKV, capture_prompt, generate_from_state


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


class Snapshot(NamedTuple):
    """The bytes of every tensor a state held at :func:`snapshot`, those tensors, and the state itself."""

    bits: list[torch.Tensor]
    tensors: list[torch.Tensor]
    state: object


def snapshot(state) -> Snapshot:
    tensors = state_tensors(state)
    return Snapshot([_bits(t).clone() for t in tensors], tensors, state)


def unchanged(snap: Snapshot) -> bool:
    """Whether the state holds the bytes it held at :func:`snapshot`, read through the state object now: a layer whose
    tensors were rebound to new ones (as GDN / Mamba updates do) is compared by what it holds, not by the old tensors."""
    now = state_tensors(snap.state)
    return len(now) == len(snap.bits) and all(
        torch.equal(a, _bits(b)) for a, b in zip(snap.bits, now, strict=True)
    )


def assert_generate_matches_stock(
    model, prompt: torch.Tensor, chunk_size: int, page_size: int, sampling: dict, new_tokens: int = 8
) -> torch.Tensor:
    """Shared-prefix generation of 3 x ``new_tokens`` from a captured ``prompt`` draws the tokens ``model.generate``
    draws on the whole prompt (same seed, eos 7, pad 96), and leaves the captured state unchanged; returns them."""
    state = capture_prompt(model, prompt, chunk_size=chunk_size, page_size=page_size)
    snap = snapshot(state)
    torch.manual_seed(5)
    ids = generate_from_state(state, model, 3, new_tokens, eos_token_id=7, pad_token_id=96, **sampling)
    inp = prompt[None].expand(3, -1)
    torch.manual_seed(5)
    ref = model.generate(
        inp,
        attention_mask=torch.ones_like(inp),
        max_new_tokens=new_tokens,
        eos_token_id=7,
        pad_token_id=96,
        **sampling,
    )[:, prompt.numel() :]
    assert torch.equal(ids, ref)
    assert unchanged(snap)
    return ids
