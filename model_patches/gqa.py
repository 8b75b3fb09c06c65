"""Plain decoder models with grouped-query attention: ``llama``, ``qwen2``, ``qwen3``, ``qwen3_moe``, ``glm4_moe``
(GLM-4.5 / 4.6 / 4.7).

Nothing in their HF modeling code needs replacing: each attention module calls the attention interface,
which the engine dispatches to prompt-page attention when a replay context is passed down. What differs
between them happens before that call (qk-norm, attention bias, GLM's partial rotary on the first half of
each head) or outside attention (dense / MoE MLPs, GLM's grouped router and shared experts), all of which
run stock on the response tokens. Qwen2 / Qwen3 (``use_sliding_window=True``: sliding layers from
``max_window_layers`` on, in ``config.layer_types``) and Qwen3-MoE (one window for every layer) keep a
:class:`~longstraw_trl.layer_state.WindowKV` on their sliding layers, as every sliding-window family
(:class:`~.base.SlidingWindowPatch`).
"""

from __future__ import annotations

from .base import SlidingWindowPatch


class GQAPatch(SlidingWindowPatch):
    model_types = ("llama", "qwen2", "qwen3", "qwen3_moe", "glm4_moe")
