"""PEFT adapters in graph-free passes: run them in their base layer's dtype.

PEFT upcasts adapter weights to fp32 beside a bf16 model (``autocast_adapter_dtype=True``, its default), so
every adapted linear layer casts its input to fp32 and runs two fp32 GEMMs, which get no bf16 tensor-core
rate. In a capture of the whole Qwen3.6-27B with LoRA r=64 on every linear layer that is about a quarter of
the GPU time (fp32 GEMMs and the casts around them; ``bench/results/profile_capture_qwen3.6-27b.json``).

Without autograd nothing reads the fp32 copies but the forward itself, so for the duration of a capture or
a generation :func:`adapters_in_model_dtype` points each adapter parameter at a copy in its base layer's
dtype and restores the original afterwards. The adapter's contribution is then rounded to bf16 before it is
added, an error of the order of bf16 rounding of that contribution, which is itself added to (and rounded
with) the base layer's bf16 output. The passes that train or score (every replay: policy, old and reference
log-probs) never use it: they run the adapters exactly as PEFT does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .errors import LongStrawError


def _adapter_parameters(model: nn.Module) -> Iterator[tuple[nn.Parameter, torch.dtype]]:
    """``(parameter, base dtype)`` for each adapter parameter whose dtype differs from its base layer's."""
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        weight = getattr(base, "weight", None)
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            continue
        for name in ("lora_A", "lora_B"):
            adapters = getattr(module, name, None)
            if not isinstance(adapters, nn.ModuleDict):
                continue
            for param in adapters.parameters():
                if param.is_floating_point() and param.dtype != weight.dtype:
                    yield param, weight.dtype


@contextlib.contextmanager
def adapters_in_model_dtype(model: nn.Module, enabled: bool = True) -> Iterator[int]:
    """Inside the block, adapter parameters hold copies in their base layer's dtype (graph-free only).

    Yields how many parameters were cast. Nothing changes for a model without adapters, with adapters
    already in the model's dtype, on fp32 models, or when ``enabled`` is False.
    """
    if not enabled:
        yield 0
        return
    if torch.is_grad_enabled():
        raise LongStrawError(
            "adapters_in_model_dtype is for graph-free passes: enter it under torch.no_grad()"
        )
    originals = []
    try:
        for param, dtype in _adapter_parameters(model):
            originals.append((param, param.data))
            param.data = param.data.to(dtype)
        yield len(originals)
    finally:
        for param, data in originals:
            param.data = data
