"""Model-family patches (one module per family) and :func:`patch_model`, the one entry point."""

from __future__ import annotations

from torch import nn

from longstraw_trl.errors import UnsupportedModelError

from .base import FamilyPatch, SlidingWindowPatch
from .cohere2 import Cohere2Patch, apply_longstraw_to_cohere2
from .gemma2 import Gemma2Patch, apply_longstraw_to_gemma2
from .gemma3 import Gemma3TextPatch, apply_longstraw_to_gemma3
from .glm_moe_dsa import (
    DeepseekV32Patch,
    DSAPatch,
    GlmMoeDsaPatch,
    apply_longstraw_to_deepseek_v32,
    apply_longstraw_to_glm_moe_dsa,
)
from .gpt_oss import GptOssPatch, apply_longstraw_to_gpt_oss
from .gqa import GQAPatch, apply_longstraw_to_gqa
from .mistral import MistralPatch, apply_longstraw_to_mistral
from .qwen3_5 import (
    GatedDeltaNetHybridPatch,
    Qwen3_5Patch,
    apply_longstraw_to_qwen3_5,
    apply_longstraw_to_qwen3_5_moe,
)
from .qwen3_next import Qwen3NextPatch, apply_longstraw_to_qwen3_next

_PATCHES: list[FamilyPatch] = [
    GQAPatch(),
    Qwen3_5Patch(),
    Qwen3NextPatch(),
    MistralPatch(),
    Cohere2Patch(),
    Gemma2Patch(),
    Gemma3TextPatch(),
    GptOssPatch(),
    GlmMoeDsaPatch(),
    DeepseekV32Patch(),
]

PATCH_ATTR = "_longstraw_patch"


def register_family(patch: FamilyPatch) -> None:
    """Add a family patch (later registrations win for the same ``model_type``)."""
    _PATCHES.insert(0, patch)


def supported_model_types() -> list[str]:
    return sorted({t for p in _PATCHES for t in p.model_types})


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers model under a peft / accelerate / DDP wrapper."""
    while True:
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            inner = model.get_base_model()
        elif hasattr(model, "module") and isinstance(model.module, nn.Module):
            inner = model.module
        else:
            return model
        if inner is model:
            return model
        model = inner


def patch_for_model_type(model_type: str | None, what: str = "") -> FamilyPatch:
    """The family patch serving ``config.model_type`` (``what`` names the model in the error)."""
    for patch in _PATCHES:
        if model_type in patch.model_types:
            return patch
    raise UnsupportedModelError(
        f"model_type {model_type!r}{what} is not supported by LongStraw-TRL; "
        f"supported model types: {', '.join(supported_model_types())}"
    )


def find_patch(model: nn.Module) -> FamilyPatch:
    base = unwrap_model(model)
    config = getattr(base, "config", None)
    return patch_for_model_type(getattr(config, "model_type", None), f" ({type(base).__name__})")


def patch_model(model: nn.Module) -> nn.Module:
    """Make ``model`` replayable from a captured prompt state. Idempotent; peft-wrapped models work.

    The model keeps behaving exactly as before for ordinary calls (``forward``, ``generate``): the
    LongStraw paths only run when the engine passes its context down.
    Raises :class:`UnsupportedModelError` naming the supported model types otherwise.
    """
    from longstraw_trl.engine import install_engine

    base = unwrap_model(model)
    patch = find_patch(base)
    if getattr(base, PATCH_ATTR, None) is patch:
        return model
    if not hasattr(base, "get_output_embeddings") or base.get_output_embeddings() is None:
        raise UnsupportedModelError(f"{type(base).__name__} has no LM head; pass a *ForCausalLM model")
    patch.validate(base)
    install_engine(base, patch.decoder(base))
    patch.apply(base)
    setattr(base, PATCH_ATTR, patch)
    return model


__all__ = [
    "Cohere2Patch",
    "DSAPatch",
    "DeepseekV32Patch",
    "FamilyPatch",
    "GQAPatch",
    "GatedDeltaNetHybridPatch",
    "Gemma2Patch",
    "Gemma3TextPatch",
    "GlmMoeDsaPatch",
    "GptOssPatch",
    "MistralPatch",
    "SlidingWindowPatch",
    "Qwen3NextPatch",
    "Qwen3_5Patch",
    "UnsupportedModelError",
    "apply_longstraw_to_cohere2",
    "apply_longstraw_to_deepseek_v32",
    "apply_longstraw_to_gemma2",
    "apply_longstraw_to_gemma3",
    "apply_longstraw_to_glm_moe_dsa",
    "apply_longstraw_to_gpt_oss",
    "apply_longstraw_to_gqa",
    "apply_longstraw_to_mistral",
    "apply_longstraw_to_qwen3_5",
    "apply_longstraw_to_qwen3_5_moe",
    "apply_longstraw_to_qwen3_next",
    "find_patch",
    "patch_for_model_type",
    "patch_model",
    "register_family",
    "supported_model_types",
    "unwrap_model",
]
