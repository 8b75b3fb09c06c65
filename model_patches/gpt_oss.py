"""GPT-OSS (``gpt_oss``): alternating sliding-window / full attention with attention sinks, and MoE.

Each attention module passes its learnable per-head ``sinks`` as ``s_aux`` to the attention interface;
the engine adds ``exp(sink_h)`` to every softmax denominator as one more term of the LSE merge, with its
gradient (``kernels.attention.merge_sink``). The MoE blocks run unchanged through the root forward.
"""

from __future__ import annotations

from .base import SlidingWindowPatch


class GptOssPatch(SlidingWindowPatch):
    model_types = ("gpt_oss",)
