"""How LongStraw enters a Hugging Face model (:func:`install_engine`, idempotent; methods bound per instance, so
``deepcopy`` rebinds them).

- the attention dispatch: every attention implementation registered in transformers is wrapped so that, when a
  :class:`~longstraw_trl.context.ForwardContext` is passed down as the ``longstraw`` keyword, attention runs through
  it, and otherwise falls through to the original implementation untouched;
- the output head: inside a LongStraw call it computes what the engine requests (:func:`head_request`: token
  log-probs, or nothing during capture) instead of full logits;
- the decoder layers: checkpointed per call when the context asks for it.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .context import CTX_KWARG


# ----------------------------------------------------------------------------------------------------
# Attention dispatch
# ----------------------------------------------------------------------------------------------------
def _dispatching(fallback: Callable | None) -> Callable:
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        ctx = kwargs.pop(CTX_KWARG, None)
        if ctx is None:
            fn = fallback or sys.modules[type(module).__module__].eager_attention_forward
            return fn(module, query, key, value, attention_mask, *args, **kwargs)
        scale = kwargs.get("scaling") or getattr(module, "scaling", query.shape[-1] ** -0.5)
        # the variant keywords of HF's attention interface, exactly as the stock attention receives them
        variant = dict(
            sliding_window=kwargs.get("sliding_window"),
            softcap=kwargs.get("softcap"),
            sinks=kwargs.get("s_aux"),
        )
        return ctx.attend(module, query, key, value, scale, **variant), None

    attention._longstraw_dispatch = True
    return attention


def install_attention_dispatch() -> None:
    """Wrap every attention implementation registered in transformers (idempotent)."""
    from transformers.modeling_utils import AttentionInterface

    mapping = AttentionInterface._global_mapping
    for name, fn in list(mapping.items()):
        if not getattr(fn, "_longstraw_dispatch", False):
            mapping[name] = _dispatching(fn)
    if "eager" not in mapping:  # eager is each modeling file's own function, looked up per module
        mapping["eager"] = _dispatching(None)


# ----------------------------------------------------------------------------------------------------
# The output head and the decoder layers
# ----------------------------------------------------------------------------------------------------


# What the output head computes during one LongStraw call (set by the engine around the root forward).
# ``None``: the stock head (logits). Otherwise a callable ``(stock_head, hidden) -> result``.
_HEAD_REQUEST: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "longstraw_head", default=None
)


def _head_forward(self, hidden_states):
    """The output head's forward, bound per instance: the stock head unless the engine asked for more."""
    stock = self._longstraw_stock_forward or type(self).forward.__get__(self)
    request = _HEAD_REQUEST.get()
    if request is None:
        return stock(hidden_states)
    token = _HEAD_REQUEST.set(None)  # a head wrapped inside this one (peft) runs stock
    try:
        return request(stock, hidden_states)
    finally:
        _HEAD_REQUEST.reset(token)


def install_head(base: nn.Module) -> None:
    """Bind the output head's LongStraw forward (idempotent; again after peft wrapped the head)."""
    head = base.get_output_embeddings()
    if getattr(head, "_longstraw_head", False):
        return
    head._longstraw_stock_forward = head.__dict__.get("forward")  # an accelerate hook, if one is installed
    head.forward = _head_forward.__get__(head)
    head._longstraw_head = True


def _layer_forward(self, *args, **kwargs):
    """A decoder layer's forward, bound per instance: checkpointed when the call asks for it."""
    stock = type(self).forward.__get__(self)
    ctx = kwargs.get(CTX_KWARG)
    hf_checkpoints = getattr(self, "gradient_checkpointing", False) and self.training
    ours = ctx is not None and ctx.checkpoint_layers and torch.is_grad_enabled() and not hf_checkpoints
    if ctx is not None:  # read by the layer's attention (ForwardContext._prompt_part)
        ctx.layer_recomputed = bool(hf_checkpoints or ours)
    if ours:
        return checkpoint(_forward_without_hf_checkpointing, self, *args, use_reentrant=False, **kwargs)
    return stock(*args, **kwargs)


def _forward_without_hf_checkpointing(layer: nn.Module, *args, **kwargs):
    """The layer's stock forward with HF's own checkpointing off, in the forward and in its recompute alike.

    transformers checkpoints inside ``forward`` when the layer's ``gradient_checkpointing`` flag is set at call time.
    A call that checkpoints with the engine's own checkpointing has HF's switched off while it runs (a recomputed
    segment, the full gradient's replays), but its backward may run after the flags are back on (the trainer's
    ``accelerator.backward``): the recompute would then nest HF's checkpoint inside ours and save other tensors than
    the forward did (``CheckpointError: A different number of tensors was saved``)."""
    stock = type(layer).forward.__get__(layer)
    if getattr(layer, "gradient_checkpointing", False) is not True:
        return stock(*args, **kwargs)
    layer.gradient_checkpointing = False
    try:
        return stock(*args, **kwargs)
    finally:
        layer.gradient_checkpointing = True


def install_engine(base: nn.Module, decoder: nn.Module) -> None:
    """What every family needs (idempotent): the attention dispatch, the output head's LongStraw request,
    and per-call layer checkpointing. Methods are bound per instance, so ``deepcopy`` rebinds them."""
    install_attention_dispatch()
    install_head(base)
    for layer in decoder.layers:
        if not getattr(layer, "_longstraw_layer", False):
            layer.forward = _layer_forward.__get__(layer)
            layer._longstraw_layer = True


@contextlib.contextmanager
def head_request(request: Callable | None) -> Iterator[None]:
    """Within the block, the output head computes ``request(stock_head, hidden)`` (``None``: the stock head)."""
    token = _HEAD_REQUEST.set(request)
    try:
        yield
    finally:
        _HEAD_REQUEST.reset(token)


def skip_head(stock, hidden):
    """Head request of a call that needs no logits (a capture chunk): an empty tensor."""
    return hidden.new_empty(*hidden.shape[:-1], 0)


def zero_hidden(stock, hidden):
    """Head request of a recomputed prompt chunk under FSDP2: ``0 * sum(hidden)``, a zero term whose backward reaches
    the last decoder layer's output (where FSDP2 gathers that layer's parameters for backward), without logits."""
    return hidden.sum() * 0.0
