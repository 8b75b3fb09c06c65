"""Cohere 2 (``cohere2``, Command R7B / Command A): alternating sliding-window and full attention layers.

Its full layers apply no RoPE (the module skips it; the engine attends to whatever K/V it is given),
and ``Cohere2ForCausalLM`` multiplies the head's logits by ``logit_scale``, which the engine's head
request must apply too (:meth:`logits_transform`). Parallel attention + MLP blocks and LayerNorm run
unchanged through the root forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from .base import SlidingWindowPatch


class Cohere2Patch(SlidingWindowPatch):
    model_types = ("cohere2",)

    def logits_transform(self, model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        return functools.partial(torch.mul, other=model.logit_scale)
