"""Gemma 2 (``gemma2``): alternating sliding-window and global layers with soft-capped attention scores.

The attention module passes ``softcap`` (``attn_logit_softcapping``) and its scaling
(``query_pre_attn_scalar ** -0.5``) to the attention interface, so the engine soft-caps every score
before the LSE merge (on the plain-math path: flash / cuDNN cannot soft-cap); ``Gemma2ForCausalLM``
soft-caps the final logits (``final_logit_softcapping``), which the engine's head request applies too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from longstraw_trl.kernels.logprob import softcap_logits

from .base import SlidingWindowPatch


class Gemma2Patch(SlidingWindowPatch):
    model_types = ("gemma2",)

    def logits_transform(self, model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
        cap = getattr(self.text_config(model), "final_logit_softcapping", None)
        return None if cap is None else functools.partial(softcap_logits, cap=cap)
