"""The values the config validates against, kept apart from the runtime so that the config stays plain data.

Standard library only: `longstraw_trl.config` imports this module and nothing of the engine, the kernels or the
distributed layer.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path

DEFAULT_CHUNK_SIZE = 8192
"""Prompt tokens per prefill step of a capture (`capture_chunk_size`)."""
DEFAULT_PAGE_SIZE = 16384
"""Tokens per K/V page of the full-attention layers (`page_size`)."""
DEFAULT_REPLAY_BATCH_TOKENS = 8192
"""Padded response tokens replayed together under autograd (`replay_batch_tokens`)."""

AUTO = "auto"
"""The value of a memory setting the trainer's pre-flight plan chooses."""
AUTO_PREFERRED = {
    "capture_chunk_size": DEFAULT_CHUNK_SIZE,
    "replay_batch_tokens": DEFAULT_REPLAY_BATCH_TOKENS,
}
"""The value an `"auto"` setting takes where the step fits with it, and where no plan is made."""


def preferred_if_auto(name: str, value):
    """`value` of the setting `name`, `"auto"` as its preferred value (:data:`AUTO_PREFERRED`)."""
    return AUTO_PREFERRED[name] if value == AUTO else value


def resolved(args, name: str):
    """The config's `name` with `"auto"` as its preferred value (:data:`AUTO_PREFERRED`) until a plan chooses."""
    return preferred_if_auto(name, getattr(args, name))


REFRESH_POLICIES = ("recapture", "reuse", "adaptive")
"""`refresh_policy` values (`longstraw_trl.refresh.RefreshPolicy`)."""
OFFLOAD_CHOICES = ("auto", None, "cpu")
"""`offload_prompt_state` values: the pre-flight plan's choice, the model's device, or pinned host memory."""
EP_IMPLEMENTATIONS = ("all_reduce", "all_to_all")
"""transformers' ``ep_implementation`` values that run on a batch shared by the EP group (both run over gloo)."""
KERNEL_CACHE_SUBDIR = "_longstraw_kernel_cache"
"""`kernel_cache_dir="auto"`: this folder of `output_dir` ("_": kept out of TRL's `push_to_hub` uploads)."""

CACHE_ENV = "LONGSTRAW_CACHE"
"""The environment variable naming the cache root (converted checkpoints, GGUF files, the Qwen tokenizer)."""


class GradientMode(str, enum.Enum):
    """Which gradient a training step back-propagates (`LongStrawGRPOConfig.gradient_mode`).

    `RESPONSE`: the prompt state is a constant; gradients reach the weights through the last prompt token and the
    responses. `FULL`: TRL's full-sequence gradient, the prompt's tokens too (the replays accumulate the prompt
    state's gradient, then the capture chunks are recomputed under autograd in reverse order).
    """

    RESPONSE = "response_only"
    FULL = "full"

    @classmethod
    def parse(cls, value: str | GradientMode) -> GradientMode:
        """The mode named by ``value`` (``"response_only"``, its short form ``"response"``, or ``"full"``)."""
        if isinstance(value, cls):
            return value
        text = str(value).strip().lower()
        if text == "response":
            return cls.RESPONSE
        try:
            return cls(text)
        except ValueError:
            names = ", ".join(repr(mode.value) for mode in cls)
            raise ValueError(f"gradient_mode must be one of {names}, got {value!r}.") from None

    @property
    def full(self) -> bool:
        """Whether the prompt's tokens are back-propagated too."""
        return self is GradientMode.FULL

    def objective(self) -> str:
        """One line naming this mode's gradient and how it differs from TRL's ``GRPOTrainer`` (the trainer logs it
        at construction)."""
        if self.full:
            return (
                "gradient_mode='full': TRL's full-sequence GRPO gradient, as GRPOTrainer computes it (the prompt's "
                "chunks are recomputed under autograd after the replays)"
            )
        return (
            "gradient_mode='response_only': the prompt's state is captured without autograd and held constant, so "
            "gradients reach the weights through the responses and the last prompt token only; GRPOTrainer also "
            "back-propagates through the prompt's tokens, so gradients (and grad_norm) differ from TRL's. "
            "gradient_mode='full' gives TRL's gradient (docs/design.md, 'Objective')"
        )

    def __str__(self) -> str:
        return self.value


GRADIENT_MODES = tuple(mode.value for mode in GradientMode)
"""`gradient_mode` values as users spell them."""


class PrefixSharing(str, enum.Enum):
    """Which common prefixes of prompts are captured once (`LongStrawGRPOConfig.prompt_prefix_sharing`).

    `OFF`: only a prompt that extends a whole cached prompt reuses its state. `BATCH`: also the common prefixes at
    which a generation batch's prompts branch (each trunk captured once as a prompt of its own, the prompts extend
    it); nothing is kept at capture-chunk boundaries. `ALL`: also a later prompt branches off any cached state it
    shares a prefix with, for which policy captures keep their fixed-size layers' states (GDN, sliding windows) at
    every capture-chunk boundary. Truthy unless `OFF`.
    """

    OFF = "off"
    BATCH = "batch"
    ALL = "all"

    @classmethod
    def parse(cls, value: str | bool | PrefixSharing) -> PrefixSharing:
        """The mode named by ``value``: ``"off"``, ``"batch"`` or ``"all"``; ``True`` (or ``"true"``) is ``"all"``,
        ``False`` (or ``"false"``) is ``"off"``."""
        if isinstance(value, cls):
            return value
        if isinstance(value, bool):
            return cls.ALL if value else cls.OFF
        text = str(value).strip().lower()
        text = {"true": cls.ALL.value, "false": cls.OFF.value}.get(text, text)
        try:
            return cls(text)
        except ValueError:
            names = ", ".join(repr(mode.value) for mode in cls)
            raise ValueError(
                f"prompt_prefix_sharing must be one of {names} (or True for 'all', False for 'off'), got {value!r}."
            ) from None

    @property
    def batch_trunks(self) -> bool:
        """Whether the common prefixes at which a generation batch's prompts branch are captured once."""
        return self is not PrefixSharing.OFF

    @property
    def cached_branches(self) -> bool:
        """Whether a prompt branches off any cached state it shares a prefix with (inside it, at a kept
        capture-chunk boundary), which needs the fixed-size layers' states kept at every boundary."""
        return self is PrefixSharing.ALL

    def __bool__(self) -> bool:
        return self is not PrefixSharing.OFF

    def __str__(self) -> str:
        return self.value


PREFIX_SHARING_MODES = tuple(mode.value for mode in PrefixSharing)
"""`prompt_prefix_sharing` values as users spell them."""


def cache_root() -> Path:
    """The cache root: ``$LONGSTRAW_CACHE``, else ``~/.cache/longstraw``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "longstraw")
