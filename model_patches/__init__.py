"""Model-family patches: one module per family (its :class:`FamilyPatch`: what the family does differently), and
here the one table from ``model_type`` to patch, :func:`patch_model` (the one entry point) and the
``apply_longstraw_to_<family>`` functions (as Liger-Kernel's ``monkey_patch.py``)."""

from __future__ import annotations

from torch import nn

from longstraw_trl.errors import UnsupportedModelError
from longstraw_trl.hooks import install_engine

from .base import FamilyPatch, SlidingWindowPatch, unwrap_model
from .cohere2 import Cohere2Patch
from .gemma2 import Gemma2Patch
from .gemma3 import Gemma3TextPatch
from .glm_moe_dsa import DeepseekV32Patch, DSAPatch, GlmMoeDsaPatch
from .gpt_oss import GptOssPatch
from .gqa import GQAPatch
from .mistral import MistralPatch
from .nemotron_h import NemotronHPatch
from .qwen3_5 import GatedDeltaNetHybridPatch, Qwen3_5Patch
from .qwen3_next import Qwen3NextPatch

# The family patches, in lookup order, each with its ``apply_longstraw_to_<name>`` entry points (name: the models it
# patches, for its docstring). GQA's is the generic one: like patch_model, it takes any supported model.
_FAMILIES: list[tuple[FamilyPatch, dict[str, str]]] = [
    (GQAPatch(), {"gqa": "a llama / qwen2 / qwen3 / qwen3_moe / glm4_moe model"}),
    (
        Qwen3_5Patch(),
        {
            "qwen3_5": "a Qwen3.5 / Qwen3.6 model (``qwen3_5``)",
            "qwen3_5_moe": "a Qwen3.5-MoE model (``qwen3_5_moe``)",
        },
    ),
    (Qwen3NextPatch(), {"qwen3_next": "a Qwen3-Next model (``qwen3_next``)"}),
    (MistralPatch(), {"mistral": "a Mistral / Ministral model"}),
    (Cohere2Patch(), {"cohere2": "a Cohere 2 model"}),
    (Gemma2Patch(), {"gemma2": "a Gemma 2 model"}),
    (Gemma3TextPatch(), {"gemma3": "a Gemma 3 text model (``Gemma3ForCausalLM``)"}),
    (GptOssPatch(), {"gpt_oss": "a GPT-OSS model"}),
    (GlmMoeDsaPatch(), {"glm_moe_dsa": "a GLM-5 model (``glm_moe_dsa``)"}),
    (DeepseekV32Patch(), {"deepseek_v32": "a DeepSeek-V3.2 model (``deepseek_v32``)"}),
    (NemotronHPatch(), {"nemotron_h": "a Nemotron-H model (``nemotron_h``)"}),
]
_GENERIC_ENTRY_POINTS = ("gqa",)

_PATCHES: list[FamilyPatch] = [patch for patch, _ in _FAMILIES]

PATCH_ATTR = "_longstraw_patch"

# Why a known architecture has no patch (the error names it, beside the supported types).
_UNSUPPORTED_WHY = {
    t: "its Mamba / selective-state-space layers are not wired to LongStraw's Mamba-2 state (the supported "
    "state-space hybrid is nemotron_h; bamba, granitemoehybrid, falcon_h1, zamba2 and mamba2 share its scan but have "
    "no family patch yet), and the other supported hybrids are Gated DeltaNet: qwen3_5, qwen3_5_moe, qwen3_next"
    for t in (
        "mamba",
        "mamba2",
        "falcon_mamba",
        "falcon_h1",
        "jamba",
        "bamba",
        "granitemoehybrid",
        "zamba",
        "zamba2",
    )
}
_CUSTOM_CODE_WHY = (
    "it is custom modeling code (trust_remote_code), and LongStraw patches transformers' own modeling code, one "
    "family at a time; load a transformers architecture (trust_remote_code=False)"
)


def register_family(patch: FamilyPatch) -> None:
    """Add a family patch (later registrations win for the same ``model_type``)."""
    _PATCHES.insert(0, patch)


def supported_model_types() -> list[str]:
    return sorted({t for p in _PATCHES for t in p.model_types})


def patch_for_model_type(model_type: str | None, what: str = "", custom_code: bool = False) -> FamilyPatch:
    """The family patch serving ``config.model_type`` (``what`` names the model in the error; ``custom_code``: its
    class comes from a Hub repo's own code, which the error says)."""
    for patch in _PATCHES:
        if model_type in patch.model_types:
            return patch
    why = _CUSTOM_CODE_WHY if custom_code else _UNSUPPORTED_WHY.get(model_type)
    raise UnsupportedModelError(
        f"model_type {model_type!r}{what} is not supported by LongStraw-TRL"
        + (f": {why}" if why else "")
        + f"; supported model types: {', '.join(supported_model_types())}"
    )


def find_patch(model: nn.Module) -> FamilyPatch:
    base = unwrap_model(model)
    config = getattr(base, "config", None)
    custom_code = type(base).__module__.startswith(
        "transformers_modules"
    )  # trust_remote_code's dynamic modules
    return patch_for_model_type(getattr(config, "model_type", None), f" ({type(base).__name__})", custom_code)


def patch_model(model: nn.Module) -> nn.Module:
    """Make ``model`` replayable from a captured prompt state. Idempotent; peft-wrapped models work.

    The model keeps behaving exactly as before for ordinary calls (``forward``, ``generate``): the
    LongStraw paths only run when the engine passes its context down.
    Raises :class:`UnsupportedModelError` naming the supported model types otherwise.
    """
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


def apply_family_patch(model: nn.Module, patch_type: type[FamilyPatch]) -> nn.Module:
    """:func:`patch_model` for an ``apply_longstraw_to_<family>`` entry point: the model must be that family."""
    if not isinstance(find_patch(model), patch_type):
        base = unwrap_model(model)
        raise UnsupportedModelError(
            f"{type(base).__name__} (model_type {base.config.model_type!r}) is not one of "
            f"{', '.join(patch_type.model_types)}; patch_model(model) picks the right family"
        )
    return patch_model(model)


def _entry_point(name: str, patch_type: type[FamilyPatch] | None, models: str):
    """``apply_longstraw_to_<name>``: :func:`apply_family_patch` for ``patch_type`` (None: :func:`patch_model`)."""

    def apply(model: nn.Module) -> nn.Module:
        return patch_model(model) if patch_type is None else apply_family_patch(model, patch_type)

    apply.__name__ = apply.__qualname__ = f"apply_longstraw_to_{name}"
    apply.__doc__ = f"Patch {models} in place (same as :func:`patch_model`)."
    return apply


_ENTRY_POINTS = {
    f"apply_longstraw_to_{name}": _entry_point(
        name, None if name in _GENERIC_ENTRY_POINTS else type(patch), models
    )
    for patch, names in _FAMILIES
    for name, models in names.items()
}
globals().update(_ENTRY_POINTS)

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
    "NemotronHPatch",
    "SlidingWindowPatch",
    "Qwen3NextPatch",
    "Qwen3_5Patch",
    "UnsupportedModelError",
    "apply_family_patch",
    "find_patch",
    "patch_for_model_type",
    "patch_model",
    "register_family",
    "supported_model_types",
    "unwrap_model",
    *sorted(_ENTRY_POINTS),
]
