"""GPT-OSS (``gpt_oss``): alternating sliding-window / full attention with attention sinks, and MoE.

Each attention module passes its learnable per-head ``sinks`` as ``s_aux`` to the attention interface;
the engine adds ``exp(sink_h)`` to every softmax denominator as one more term of the LSE merge, with its
gradient (``kernels.attention.merge_sink``). The MoE blocks run unchanged through the root forward.
"""

from __future__ import annotations

from torch import nn

from .base import SlidingWindowPatch, apply_family_patch


class GptOssPatch(SlidingWindowPatch):
    model_types = ("gpt_oss",)


def apply_longstraw_to_gpt_oss(model: nn.Module) -> nn.Module:
    """Patch a GPT-OSS model in place (same as :func:`patch_model`)."""
    return apply_family_patch(model, GptOssPatch)
