"""The options of each concern of a step, resolved once from a `LongStrawGRPOConfig` and passed on.

Each class names its fields as the config does (`capture_chunk_size`, `offload_prompt_state`,
`prompt_prefix_sharing`, `gradient_mode`, ...), so an option has one name from the config down to the layer that
reads it. `from_config` reads any object with the config's attribute names (the config itself, or an argparse
namespace of the same names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .constants import GradientMode, PrefixSharing, resolved

__all__ = ["CaptureOptions", "GradientMode", "LossOptions", "PrefixSharing", "plan_options"]


def _gradient_mode(options: Any) -> None:
    """Normalise a frozen dataclass's ``gradient_mode`` to a :class:`GradientMode` (strings are accepted)."""
    object.__setattr__(options, "gradient_mode", GradientMode.parse(options.gradient_mode))


@dataclass(frozen=True)
class CaptureOptions:
    """How the trainer captures prompts (the config's fields of the same names).

    Args:
        capture_chunk_size: prompt tokens per prefill step (``None``: the engine's default).
        page_size: tokens per K/V page (``None``: the engine's default).
        offload_prompt_state: ``None`` or ``"cpu"`` (the state's offloadable tensors in pinned host memory).
        prompt_prefix_sharing: which common prefixes of prompts are captured once (a :class:`PrefixSharing`; its
            names and ``True`` / ``False`` are accepted): ``"batch"``, the prompts of a generation batch through
            their prompt trie (each trunk captured once, the prompts extend it: :attr:`batch_trunks`); ``"all"``,
            also later prompts from any cached state they share a prefix with, for which policy captures keep their
            fixed-size layers' states (GDN, sliding windows) at every capture-chunk boundary; ``"off"``, neither.
        gradient_mode: :attr:`GradientMode.FULL` keeps what the prompt backward needs (policy captures only).
        cp_group: the context-parallel group the pages are spread over (``None``: one rank).
    """

    capture_chunk_size: int | None = None
    page_size: int | None = None
    offload_prompt_state: str | None = None
    prompt_prefix_sharing: PrefixSharing = PrefixSharing.BATCH
    gradient_mode: GradientMode = GradientMode.RESPONSE
    cp_group: object = None

    def __post_init__(self) -> None:
        _gradient_mode(self)
        object.__setattr__(self, "prompt_prefix_sharing", PrefixSharing.parse(self.prompt_prefix_sharing))

    @property
    def batch_trunks(self) -> bool:
        """Whether the common prefixes at which a generation batch's prompts branch are captured once (a trunk
        ends at its branch point: its prompts extend it as a whole cached prompt, no boundary kept)."""
        return self.prompt_prefix_sharing.batch_trunks

    @property
    def keep_boundaries(self) -> bool:
        """Whether a policy capture keeps the fixed-size layers' states at every chunk boundary: the full
        gradient's prompt backward starts from them, and with ``prompt_prefix_sharing="all"`` a later prompt may
        branch there."""
        return self.gradient_mode.full or self.prompt_prefix_sharing.cached_branches

    @classmethod
    def from_config(cls, args: Any, cp_group: object = None) -> CaptureOptions:
        """The capture options of a config (``cp_group``: the trainer's context-parallel group)."""
        return cls(
            # "auto": the preferred value until the trainer's pre-flight plan chooses
            capture_chunk_size=resolved(args, "capture_chunk_size"),
            page_size=args.page_size,
            # "auto": on the device until the trainer's pre-flight plan decides (longstraw_trl.preflight)
            offload_prompt_state=None if args.offload_prompt_state == "auto" else args.offload_prompt_state,
            prompt_prefix_sharing=args.prompt_prefix_sharing,
            gradient_mode=args.gradient_mode,
            cp_group=cp_group,
        )


@dataclass(frozen=True)
class LossOptions:
    """How the loss replays responses (the config's fields of the same names).

    Args:
        temperature: the sampling temperature the log-probs are taken at.
        gradient_mode: :attr:`GradientMode.FULL` carries the replays' state gradient into the prompt.
        replay_block_size: reverse block replay of each response in blocks of this many tokens (``None``: whole).
        replay_batch_tokens: a group's responses replayed together while responses x longest stays within this
            (``0``: one at a time).
        replay_checkpoint_layers: recompute each decoder layer of a replay in backward.
        gradient_checkpointing: HF's activation checkpointing is on (a recomputed segment then checkpoints its
            layers with the engine's own non-reentrant checkpointing instead).
        prompt_backward_checkpoint_layers: whether the prompt backward's recomputed capture chunks checkpoint their
            layers (``None``: as the replays' segments do).
        capture_chunk_size: the router statistics' chunking (MoE load-balancing loss).
        autograd_fused_kernels: the replays and prompt-backward segments run HF's norm and MLP modules through the
            fused kernels with their own backward and plain LoRA layers' update in their base GEMM's epilogue
            (:func:`~longstraw_trl.fused_forwards.replay_forwards`).
    """

    temperature: float = 1.0
    gradient_mode: GradientMode = GradientMode.RESPONSE
    replay_block_size: int | None = None
    replay_batch_tokens: int = 8192
    replay_checkpoint_layers: bool = False
    gradient_checkpointing: bool = False
    capture_chunk_size: int | None = None
    prompt_backward_checkpoint_layers: bool | None = None
    autograd_fused_kernels: bool = False

    def __post_init__(self) -> None:
        _gradient_mode(self)

    @property
    def segment_checkpoint_layers(self) -> bool | None:
        """A recomputed segment's layer checkpointing: on with either option, else as the model's own (``None``)."""
        return True if self.gradient_checkpointing or self.replay_checkpoint_layers else None

    @property
    def prompt_segment_checkpoint_layers(self) -> bool | None:
        """The prompt backward's segments: ``prompt_backward_checkpoint_layers`` if set, else as the replays'."""
        if self.prompt_backward_checkpoint_layers is not None:
            return self.prompt_backward_checkpoint_layers
        return self.segment_checkpoint_layers

    @classmethod
    def from_config(cls, args: Any, temperature: float | None = None) -> LossOptions:
        """The loss options of a config (``temperature``: the trainer's, else the config's)."""
        return cls(
            temperature=args.temperature if temperature is None else temperature,
            gradient_mode=args.gradient_mode,
            replay_block_size=args.replay_block_size,
            replay_batch_tokens=resolved(args, "replay_batch_tokens"),
            replay_checkpoint_layers=args.replay_checkpoint_layers,
            gradient_checkpointing=bool(args.gradient_checkpointing),
            capture_chunk_size=resolved(args, "capture_chunk_size"),
            prompt_backward_checkpoint_layers=args.prompt_backward_checkpoint_layers,
            autograd_fused_kernels=args.autograd_fused_kernels,
        )


def plan_options(args: Any) -> dict[str, Any]:
    """The planner's keyword arguments (`longstraw_trl.planner.plan_memory`) that a config decides: what a
    benchmark or a test plans for the trainer it runs."""
    return dict(
        num_generations=args.num_generations,
        cp_size=args.cp_size,
        ep_size=args.ep_size,
        capture_chunk_size=resolved(args, "capture_chunk_size"),
        checkpoint_layers=bool(args.gradient_checkpointing or args.replay_checkpoint_layers),
        prompt_backward_checkpoint_layers=args.prompt_backward_checkpoint_layers,
        replay_batch_tokens=resolved(args, "replay_batch_tokens"),
        gradient_mode=GradientMode.parse(args.gradient_mode).value,
        prompt_prefix_sharing=PrefixSharing.parse(args.prompt_prefix_sharing).value,
        offload_prompt_state=args.offload_prompt_state,
    )
