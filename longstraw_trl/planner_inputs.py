"""What the memory planner plans: the options of a step, named as ``LongStrawGRPOConfig`` names them, with the
hardware and the model's dtype (:class:`PlanInputs`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .constants import GradientMode, PrefixSharing
from .errors import LongStrawError
from .options import plan_options

GiB = 2**30

GPU_MEMORY_GIB = {"h200": 139.8, "h100": 79.1, "h20": 95.0, "a100-80g": 79.1, "a100-40g": 39.4}

# Host memory a rank may pin for an offloaded prompt state (``offload_prompt_state="cpu"``), by default: a DGX H200 /
# H100 host's 2 TiB shared by its 8 GPUs (``longstraw plan --host-memory GiB --ranks-per-host N``).
DEFAULT_HOST_MEMORY_GIB = 2048.0
DEFAULT_RANKS_PER_HOST = 8

#: the short keyword names :func:`~longstraw_trl.planner.plan_memory` also takes, and the fields they set
SHORT_NAMES = {
    "response_tokens": "max_completion_length",
    "checkpoint_layers": "replay_checkpoint_layers",
    "offload": "offload_prompt_state",
    "prefix_sharing": "prompt_prefix_sharing",
}


@dataclass(frozen=True)
class PlanInputs:
    """One LongStraw GRPO step as the planner sees it, per rank. The step's options carry their config names.

    Args:
        num_generations: G, the responses of a prompt.
        max_completion_length: R, the tokens of each response.
        cp_size: context-parallel ranks sharing the prompt pages.
        ep_size: expert-parallel ranks sharing the routed experts.
        fsdp_size: ranks the policy is sharded over with FSDP2 (0: not wrapped; 1: FSDP2 on one GPU, whose shards are
            the whole parameters and whose gathered copies are all overhead).
        lora_rank: the LoRA rank (``None``: full fine-tuning).
        optimizer: ``"adamw"`` (two states per trainable parameter) or ``"none"`` (a benchmark that only runs
            backward).
        gpu_memory_gib: the GPU's memory.
        host_memory_gib: the host memory this rank may pin (its share of the host's).
        capture_chunk_size: prompt tokens per prefill step; also the full gradient's recomputed segment.
        page_size: tokens per K/V page.
        dtype_bytes: bytes of an element of the model's dtype.
        adapter_dtype_bytes: bytes a LoRA parameter, its gradient and each AdamW state take (``None``: 4, PEFT's fp32
            adapters, ``autocast_adapter_dtype=True``; 2 for adapters kept in bf16).
        replay_checkpoint_layers: whether the replays recompute each decoder layer in backward (the config's
            ``replay_checkpoint_layers``, or its ``gradient_checkpointing``).
        replay_batch_tokens: responses of a group replayed together while responses x R stays within this (0: one at
            a time).
        prompt_backward_checkpoint_layers: ``gradient_mode="full"``: whether the recomputed segment checkpoints its
            layers (``None``: as ``replay_checkpoint_layers``).
        gradient_mode: :attr:`GradientMode.RESPONSE` or :attr:`GradientMode.FULL` (their names accepted).
        offload_prompt_state: ``None`` or ``"cpu"`` (the offloadable state in pinned host memory).
        device_state_bytes: with ``offload_prompt_state="cpu"``: the device share whole layers of the offloadable
            state stay within, in layer order (the rest in host memory; 0: all of it there).
        prompt_prefix_sharing: a :class:`PrefixSharing` (its names, ``True`` for ``"all"`` and ``False`` for
            ``"off"`` accepted): ``"all"`` keeps the fixed-size layer states at every capture-chunk boundary.
    """

    num_generations: int = 8
    max_completion_length: int = 2048
    cp_size: int = 1
    ep_size: int = 1
    fsdp_size: int = 0
    lora_rank: int | None = None
    optimizer: str = "adamw"
    gpu_memory_gib: float = GPU_MEMORY_GIB["h200"]
    host_memory_gib: float = DEFAULT_HOST_MEMORY_GIB / DEFAULT_RANKS_PER_HOST
    capture_chunk_size: int = 16384
    page_size: int = 16384
    dtype_bytes: int = 2
    adapter_dtype_bytes: int | None = None
    replay_checkpoint_layers: bool = False
    replay_batch_tokens: int = 8192
    prompt_backward_checkpoint_layers: bool | None = None
    gradient_mode: GradientMode = GradientMode.RESPONSE
    offload_prompt_state: str | None = None
    device_state_bytes: int = 0
    prompt_prefix_sharing: PrefixSharing = PrefixSharing.BATCH

    def __post_init__(self) -> None:
        if self.fsdp_size < 0:
            raise LongStrawError(f"fsdp_size must be >= 0 (0: not wrapped), got {self.fsdp_size}")
        try:
            object.__setattr__(self, "gradient_mode", GradientMode.parse(self.gradient_mode))
        except ValueError:
            raise LongStrawError(
                f"gradient_mode must be 'response_only' or 'full', got {self.gradient_mode!r}"
            ) from None
        try:
            object.__setattr__(self, "prompt_prefix_sharing", PrefixSharing.parse(self.prompt_prefix_sharing))
        except ValueError as error:
            raise LongStrawError(str(error)) from None
        if self.device_state_bytes < 0:
            raise LongStrawError(f"device_state_bytes must be >= 0, got {self.device_state_bytes}")
        if self.offload_prompt_state not in (None, "cpu"):
            raise LongStrawError(
                f"offload_prompt_state must be None or 'cpu', got {self.offload_prompt_state!r}"
            )

    @classmethod
    def of(cls, inputs: PlanInputs | None = None, **options: Any) -> PlanInputs:
        """``inputs`` (default: the defaults) with ``options`` changed; an option is a field's name or its short name
        (:data:`SHORT_NAMES`: ``response_tokens``, ``checkpoint_layers``, ``offload``, ``prefix_sharing``)."""
        changes: dict[str, Any] = {}
        given: dict[str, str] = {}
        for name, value in options.items():
            field_name = SHORT_NAMES.get(name, name)
            if field_name in changes:
                raise TypeError(f"{given[field_name]!r} and {name!r} both set {field_name!r}")
            changes[field_name], given[field_name] = value, name
        return dataclasses.replace(inputs or cls(), **changes)

    @classmethod
    def from_config(cls, args: Any, **options: Any) -> PlanInputs:
        """The inputs a ``LongStrawGRPOConfig`` decides (:func:`~longstraw_trl.options.plan_options`, its
        ``max_completion_length`` and ``page_size``), with ``options`` (what the config does not say: ``lora_rank``,
        ``fsdp_size``, ``gpu_memory_gib``, ...) as :meth:`of` takes them."""
        lengths = ("max_completion_length", "page_size")
        decided = {name: getattr(args, name) for name in lengths if getattr(args, name, None) is not None}
        return cls.of(cls.of(**{**decided, **plan_options(args)}), **options)

    @property
    def segment_checkpoint_layers(self) -> bool:
        """Whether the full gradient's recomputed segment checkpoints its layers."""
        if self.prompt_backward_checkpoint_layers is None:
            return self.replay_checkpoint_layers
        return self.prompt_backward_checkpoint_layers

    @property
    def replayed_together(self) -> int:
        """Responses replayed together under autograd: as many as ``replay_batch_tokens`` holds, 1 to G."""
        together = self.replay_batch_tokens // max(self.max_completion_length, 1)
        return max(1, min(self.num_generations, together))

    @property
    def trained_bytes(self) -> int:
        """Bytes of a trained parameter, its gradient and each optimizer state: PEFT keeps the adapters of a bf16 /
        fp16 model in fp32 (its ``autocast_adapter_dtype``, on by default); without LoRA the trained weights are in
        the model's dtype."""
        if self.lora_rank:
            return self.adapter_dtype_bytes or max(self.dtype_bytes, 4)
        return self.dtype_bytes
