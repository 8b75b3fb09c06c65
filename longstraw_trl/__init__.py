"""LongStraw-TRL: GRPO post-training on million-token prompts for Hugging Face TRL.

Capture the long prompt once (no autograd) into a model-native :class:`PromptState`, then generate
(:func:`generate_from_state`), score and replay (:func:`replay_logprobs`) every response on top of that read-only
state, or extend it with more prompt tokens (:func:`extend_state`).

The names below load their modules when first used (torch, transformers, TRL and Triton take seconds to import), so
``import longstraw_trl`` and ``longstraw --help`` stay fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import LongStrawError, PreflightError, PromptTooLongError, UnsupportedModelError

if TYPE_CHECKING:
    from .config import LongStrawGRPOConfig
    from .engine import capture_prompt, extend_state, prompt_backward, replay_blocks_backward, replay_logprobs
    from .fused_forwards import fused_elementwise_forwards
    from .generation import generate_from_state
    from .host_memory import DeviceShare
    from .layer_state import ConvRecurrentState, KVPages, LayerState, WindowKV
    from .model_patches import patch_model, supported_model_types
    from .model_patches.nemotron_h import Mamba2State
    from .model_patches.qwen3_5 import GDNState
    from .prompt_state import PromptState
    from .state_grads import KVGrad, StateGrads
    from .trainer import LongStrawGRPOTrainer

__version__ = "0.1.0"

# public name -> the module that defines it, imported on first use
_LAZY = {
    "capture_prompt": ".engine",
    "extend_state": ".engine",
    "prompt_backward": ".engine",
    "replay_blocks_backward": ".engine",
    "replay_logprobs": ".engine",
    "generate_from_state": ".generation",
    "DeviceShare": ".host_memory",
    "ConvRecurrentState": ".layer_state",
    "KVPages": ".layer_state",
    "LayerState": ".layer_state",
    "WindowKV": ".layer_state",
    "patch_model": ".model_patches",
    "supported_model_types": ".model_patches",
    "Mamba2State": ".model_patches.nemotron_h",
    "GDNState": ".model_patches.qwen3_5",
    "PromptState": ".prompt_state",
    "KVGrad": ".state_grads",
    "StateGrads": ".state_grads",
    "LongStrawGRPOConfig": ".trainer",
    "LongStrawGRPOTrainer": ".trainer",
    "fused_elementwise_forwards": ".fused_forwards",
}

__all__ = [
    "ConvRecurrentState",
    "DeviceShare",
    "GDNState",
    "KVGrad",
    "KVPages",
    "LayerState",
    "LongStrawError",
    "LongStrawGRPOConfig",
    "LongStrawGRPOTrainer",
    "Mamba2State",
    "PreflightError",
    "PromptState",
    "PromptTooLongError",
    "StateGrads",
    "UnsupportedModelError",
    "WindowKV",
    "capture_prompt",
    "extend_state",
    "fused_elementwise_forwards",
    "generate_from_state",
    "patch_model",
    "prompt_backward",
    "replay_blocks_backward",
    "replay_logprobs",
    "supported_model_types",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'longstraw_trl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
