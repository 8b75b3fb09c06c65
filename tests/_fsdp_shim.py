"""FSDP2 through Accelerate on a CPU-only machine (test-only).

Accelerate turns ``distributed_type: FSDP`` into its FSDP plugin only for accelerator device types
(``AcceleratorState``: MULTI_GPU, MULTI_XPU, ...); a run with ``use_cpu=True`` is MULTI_CPU and the plugin
is dropped. torch's FSDP2 itself runs on CPU over gloo (all-gather and reduce-scatter of the flat shards),
so the tests let Accelerate take its GPU branch: the process state, created for the CPU, is marked
MULTI_GPU before the trainer's ``Accelerator`` reads it, which then applies ``fully_shard`` exactly as on
GPUs (``accelerate.utils.fsdp_utils.fsdp2_prepare_model``).
"""

from __future__ import annotations

import os

import torch


def fsdp_on_cpu() -> bool:
    """Under a launch with ``ACCELERATE_USE_FSDP=true`` and no GPU, make every ``Accelerator`` of this process
    shard the model with FSDP2 on CPU. Returns whether it did."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true" or torch.cuda.is_available():
        return False
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    stock_init = PartialState.__init__

    def init_as_multi_gpu(self, cpu: bool = False, **kwargs):
        # TrainingArguments resets the process state, so every (re-)initialisation is marked
        stock_init(self, cpu, **kwargs)
        if self.distributed_type == DistributedType.MULTI_CPU:
            PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU

    PartialState.__init__ = init_as_multi_gpu
    return True


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a DTensor; a collective: every rank calls it), else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
