"""Mistral (``mistral``) and Ministral (``ministral``): Llama-shaped decoders with sliding-window attention.

Mistral applies ``config.sliding_window`` (``None``: full attention) to every layer; Ministral has the
same modeling code with a per-layer ``config.layer_types``. Each attention module passes its window to
the attention interface, which the engine dispatches; sliding layers keep only the last
``sliding_window - 1`` prompt tokens (:class:`~longstraw_trl.layer_state.WindowKV`). Nothing else differs.
"""

from __future__ import annotations

from .base import SlidingWindowPatch


class MistralPatch(SlidingWindowPatch):
    model_types = ("mistral", "ministral")
