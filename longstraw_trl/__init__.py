"""LongStraw-TRL: GRPO post-training on million-token prompts for Hugging Face TRL.

Capture the long prompt once (no autograd) into a model-native :class:`PromptState`, then generate
(:func:`generate_from_state`), score and replay (:func:`replay_logprobs`) every response on top of that read-only
state, or extend it with more prompt tokens (:func:`extend_state`).
"""

from .engine import capture_prompt, extend_state, prompt_backward, replay_blocks_backward, replay_logprobs
from .errors import LongStrawError, PromptTooLongError, UnsupportedModelError
from .generation import generate_from_state
from .layer_state import ConvRecurrentState, KVPages, LayerState, WindowKV
from .model_patches import patch_model, supported_model_types
from .model_patches.nemotron_h import Mamba2State
from .model_patches.qwen3_5 import GDNState
from .prompt_state import PromptState
from .state_grads import KVGrad, StateGrads

__version__ = "0.1.0"

__all__ = [
    "ConvRecurrentState",
    "GDNState",
    "KVGrad",
    "KVPages",
    "LayerState",
    "LongStrawError",
    "Mamba2State",
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


def __getattr__(name):  # the trainer pulls in TRL, the fused forwards Triton: import them only when asked for
    if name in ("LongStrawGRPOTrainer", "LongStrawGRPOConfig"):
        from . import trainer

        return getattr(trainer, name)
    if name == "fused_elementwise_forwards":
        from .fused_forwards import fused_elementwise_forwards

        return fused_elementwise_forwards
    raise AttributeError(f"module 'longstraw_trl' has no attribute {name!r}")
