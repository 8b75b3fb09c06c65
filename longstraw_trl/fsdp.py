"""FSDP2 (torch's ``fully_shard``, through Accelerate's FSDP plugin): what the trainer and the engine need around it.

Whether the policy is sharded with FSDP2 is decided once, from the launch (:attr:`ParallelDims.fsdp
<longstraw_trl.parallel_dims.ParallelDims>`); :func:`is_fsdp2` tells whether a given module is an FSDP2 module now.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


def is_fsdp2(model: nn.Module) -> bool:
    """Whether ``model`` is sharded with FSDP2 (torch's ``fully_shard``, e.g. through Accelerate's FSDP plugin)."""
    return isinstance(model, FSDPModule)


def stage_on_host_for_fsdp2(model: nn.Module, world: int, free_bytes: int | None = None) -> int:
    """Move a not yet sharded ``model`` whose weights are on a GPU to the host where sharding it there would not fit
    beside them; returns the bytes moved (0: left where it is).

    Accelerate 1.15's FSDP2 preparation holds every original parameter (a ``state_dict()`` it keeps) while
    ``fully_shard`` copies each into this rank's shard, so during the wrapping a GPU holds the whole model plus the
    shards: twice the model at world size 1 (the whole Qwen3.6-27B with LoRA ran out of memory inside ``prepare`` on
    an 80 GB H100, docs/fsdp.md). From the host, ``fully_shard`` moves only the shards to the GPU. HF's Trainer leaves
    an FSDP model where it is, so a model loaded on the CPU (``from_pretrained``'s default) never needs this.
    ``free_bytes``: the GPU memory the shards may take (default: free plus the allocator's cached blocks)."""
    if is_fsdp2(model):
        return 0
    tensors = [*model.parameters(), *model.buffers()]
    if any(isinstance(t, DTensor) for t in tensors):  # experts split by EP: their local shards stay
        return 0
    on_gpu = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.is_cuda}
    if not on_gpu:
        return 0
    if free_bytes is None:
        free_bytes, _ = _available_device_bytes(next(t.device for t in tensors if t.is_cuda))
    total = sum(on_gpu.values())
    # this rank's shards, the trainable ones upcast to fp32 (Accelerate's masters under mixed precision), a margin
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad and p.is_cuda)
    needed = (total + trainable) // world + 2**30
    if needed <= free_bytes:
        return 0
    model.to("cpu")
    return total


def _param_groups(unit: FSDPModule) -> list:
    # FSDP2's per-unit parameter groups (torch >= 2.11 keeps a list; earlier releases one group)
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return groups


def _available_device_bytes(device: torch.device) -> tuple[int, int]:
    """What the GPU can still give (free plus the allocator's cached blocks), and its total memory."""
    free, total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device), total


def _gather_budget_bytes(device: torch.device) -> int:
    """What the GPU can still give less a margin for the work itself (2 GiB and 5% of the card); unbounded on the
    CPU."""
    if device.type != "cuda":
        return sys.maxsize
    available, total = _available_device_bytes(device)
    return max(0, available - 2**31 - total // 20)


@contextlib.contextmanager
def fsdp2_units_kept_gathered(model: nn.Module, budget_bytes: int | None = None) -> Iterator[int]:
    """Inside the block, ``model``'s FSDP2 units stay gathered from their first forward to the block's end, as many
    (in module order) as ``budget_bytes`` of gathered parameters allow (``None``: what the GPU can still give, less a
    margin; 0: none). Yields how many units still gather (and free) around every forward: the decode step then holds
    FSDP2's collectives, which the caller keeps out of a CUDA graph.

    A decode step runs every layer for one token, and FSDP2 gathers each unit before its forward and frees it after:
    R tokens cost R all-gathers of the whole model (at world size 1 a copy of it: generation took 2.3x the unwrapped
    model's on an H100, the 27B at 64K, R = 256, docs/fsdp.md). Kept gathered, a unit costs one. Units FSDP2 already
    keeps gathered after their forward (the root; Accelerate's output head) are left as they are."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    kept: list[FSDPModule] = []
    left = 0
    try:
        if units:
            device = next(p.device for p in model.parameters())
            budget = _gather_budget_bytes(device) if budget_bytes is None else budget_bytes
            for unit in units:
                groups = _param_groups(unit)
                # only units resharded after forward (FSDP2 keeps the others gathered; an int reshard_after_forward,
                # resharding to a smaller mesh, is left as it is and still gathers)
                if not groups or all(g.post_forward_mesh_info is None for g in groups):
                    continue
                size = sum(
                    fp.sharded_param.numel() * fp.sharded_param.element_size()
                    for g in groups
                    for fp in g.fsdp_params
                )
                if size > budget or any(g.post_forward_mesh_info != g.mesh_info for g in groups):
                    left += 1
                    continue
                budget -= size
                unit.set_reshard_after_forward(False, recurse=False)
                kept.append(unit)
        yield left
    finally:
        for unit in kept:
            unit.set_reshard_after_forward(True, recurse=False)
            unit.reshard()


def fit_fsdp_wrap_classes(plugin, model: nn.Module) -> list[str]:
    """Give Accelerate's transformer-based FSDP wrap policy only the layer classes ``model`` has.

    With ``fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP`` and no layer class named, Accelerate wraps the classes
    of the model's ``_no_split_modules`` and raises for any it cannot find. A text-only model that shares its
    modeling file with a vision-language one lists the vision tower's block too (``Qwen3_5ForCausalLM``:
    ``Qwen3_5VisionBlock``), so FSDP2 refused the whole Qwen3.5/3.6 family ("Could not find the transformer layer
    class Qwen3_5VisionBlock"). Classes the user named are left alone.

    A model an earlier trainer already sharded (a second trainer on the same model, as a warm-up step then the real
    one) holds its layers as FSDP2's subclasses (``FSDPQwen3DecoderLayer``), which Accelerate does not find by the
    original name ("Could not find the transformer layer class Qwen3DecoderLayer"): the subclass's name is given then,
    and Accelerate leaves the sharded layers as they are. Returns the classes dropped."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    if plugin is None or plugin.auto_wrap_policy is not transformer_auto_wrap_policy:
        return []
    if plugin.transformer_cls_names_to_wrap is not None:
        return []
    # each module's class name; a sharded layer's original class name too, to its FSDP2 subclass's (``FSDP<name>``)
    actual: dict[str, str] = {}
    for module in model.modules():
        own = type(module).__name__
        actual.setdefault(own, own)
        if isinstance(module, FSDPModule):
            actual.setdefault(own.removeprefix("FSDP"), own)
    listed = list(getattr(model, "_no_split_modules", None) or [])
    present = [actual[name] for name in listed if name in actual]
    if present:  # none present: Accelerate's own error says so
        plugin.transformer_cls_names_to_wrap = present
    return [name for name in listed if name not in actual]
