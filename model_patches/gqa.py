"""Plain decoder models with full grouped-query attention: ``llama``, ``qwen2``, ``qwen3``, ``qwen3_moe``,
``glm4_moe`` (GLM-4.5 / 4.6 / 4.7).

Nothing in their HF modeling code needs replacing: each attention module calls the attention interface,
which the engine dispatches to prompt-page attention when a replay context is passed down. What differs
between them happens before that call (qk-norm, attention bias, GLM's partial rotary on the first half of
each head) or outside attention (dense / MoE MLPs, GLM's grouped router and shared experts), all of which
run stock on the response tokens.
"""

from __future__ import annotations

from torch import nn

from .base import FamilyPatch


class GQAPatch(FamilyPatch):
    model_types = ("llama", "qwen2", "qwen3", "qwen3_moe", "glm4_moe")

    def validate(self, model: nn.Module) -> None:
        config = self.text_config(model)
        layer_types = getattr(config, "layer_types", None) or []
        if "sliding_attention" in layer_types or getattr(config, "use_sliding_window", False):
            raise self.unsupported("sliding-window attention (use_sliding_window=True)")
        if getattr(config, "attention_dropout", 0.0):
            raise self.unsupported(f"attention_dropout={config.attention_dropout}")


def apply_longstraw_to_gqa(model: nn.Module) -> nn.Module:
    """Patch a llama / qwen2 / qwen3 / qwen3_moe / glm4_moe model in place (same as :func:`patch_model`)."""
    from . import patch_model

    return patch_model(model)
