"""How the world's ranks are split, decided and validated once per trainer (as torchtitan's ``ParallelDims``).

The world is split into consecutive context-parallel groups of ``cp`` ranks (:mod:`longstraw_trl.context_parallel`),
each split into consecutive expert-parallel groups of ``ep`` ranks (:mod:`longstraw_trl.expert_parallel`); the
policy's dense parameters are either replicated on every rank (DDP, or one process) or sharded over the whole world
by FSDP2 (:mod:`longstraw_trl.fsdp`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .errors import LongStrawError


def launched_with_fsdp(state: Any) -> bool:
    """Whether the launch Accelerate's ``state`` describes shards the policy with FSDP (``distributed_type: FSDP``):
    the one test of the launch; :func:`longstraw_trl.fsdp.is_fsdp2` tells whether a given module is sharded now."""
    return state.distributed_type == "FSDP"


def check_context_parallel_world(cp_size: int, world: int) -> None:
    """Refuse a ``cp_size`` that the launch's ``world`` processes (1 without a distributed launch) cannot split into."""
    if cp_size > 1 and world % cp_size:
        raise LongStrawError(
            f"cp_size={cp_size} needs a distributed launch whose world size is a multiple of it (got {world} "
            "process(es)); launch with e.g. `accelerate launch --config_file examples/accelerate/cp2.yaml`."
        )


def check_expert_parallel_world(ep_size: int, world: int) -> None:
    """Refuse an ``ep_size`` that the launch's ``world`` processes (1 without a distributed launch) cannot hold."""
    if ep_size > 1 and (world % ep_size or world == 1):
        raise LongStrawError(
            f"ep_size={ep_size} needs a distributed launch whose world size is a multiple of it (got {world} "
            "process(es))."
        )


@dataclass(frozen=True)
class ParallelDims:
    """The parallel dimensions of one launch, validated when made.

    Attributes:
        world: processes of the launch (1 without a distributed launch).
        cp: ranks per context-parallel group (consecutive ranks; 1: none).
        ep: ranks per expert-parallel group (consecutive ranks inside a CP group; 1: none).
        fsdp: whether the policy is sharded with FSDP2 over the world (Accelerate's ``distributed_type: FSDP``);
            otherwise it is replicated (DDP, or one process).
    """

    world: int = 1
    cp: int = 1
    ep: int = 1
    fsdp: bool = False

    def __post_init__(self) -> None:
        for name in ("world", "cp", "ep"):
            if getattr(self, name) < 1:
                raise LongStrawError(f"ParallelDims.{name} must be >= 1, got {getattr(self, name)}.")
        check_context_parallel_world(self.cp, self.world)
        check_expert_parallel_world(self.ep, self.world)

    @classmethod
    def from_launch(cls, state: Any, cp_size: int = 1, ep_size: int = 1) -> ParallelDims:
        """The dimensions of the launch Accelerate's ``state`` (an ``AcceleratorState``) describes."""
        world = state.num_processes if dist.is_initialized() else 1
        return cls(world=world, cp=cp_size, ep=ep_size, fsdp=launched_with_fsdp(state))

    @property
    def dp(self) -> int:
        """Data-parallel replicas of a prompt: the number of context-parallel groups."""
        return self.world // self.cp

    @property
    def dp_shard(self) -> int:
        """Ranks the policy's dense parameters are sharded over (1: replicated)."""
        return self.world if self.fsdp else 1
