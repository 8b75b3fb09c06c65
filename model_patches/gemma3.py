"""Gemma 3 text (``gemma3_text``, ``Gemma3ForCausalLM``): Gemma 2's layout with q/k norms and per-layer RoPE.

Sliding layers rotate with the local base frequency and global layers with the global one; HF computes
both in the root forward, so nothing here changes. HF's Gemma 3 attention does not pass
``attn_logit_softcapping`` to the attention interface (the stock model ignores it), so neither does the
engine. The final logit soft-cap is Gemma 2's (:class:`~.gemma2.Gemma2Patch`). Image inputs
(``gemma3``, ``Gemma3ForConditionalGeneration``) are not supported.
"""

from __future__ import annotations

from .gemma2 import Gemma2Patch


class Gemma3TextPatch(Gemma2Patch):
    model_types = ("gemma3_text",)
