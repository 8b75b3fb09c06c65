"""ParallelDims: the launch's world, CP and EP sizes and FSDP2, validated once with refusals that say what to change."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType

from longstraw_trl.errors import LongStrawError
from longstraw_trl.parallel_dims import ParallelDims, launched_with_fsdp


def test_dimensions_of_a_valid_launch():
    dims = ParallelDims(world=8, cp=4, ep=2, fsdp=True)
    assert (dims.dp, dims.dp_shard) == (2, 8)
    replicated = ParallelDims(world=8, cp=4, ep=2)
    assert (replicated.dp, replicated.dp_shard) == (2, 1)
    assert ParallelDims() == ParallelDims(world=1, cp=1, ep=1, fsdp=False)


@pytest.mark.parametrize(
    ("dims", "match"),
    [
        (
            dict(world=3, cp=2),
            r"cp_size=2 needs a distributed launch whose world size is a multiple of it \(got 3",
        ),
        (dict(world=1, cp=2), r"cp_size=2 needs a distributed launch .*\(got 1 process"),
        (dict(world=6, cp=6, ep=4), r"ep_size=4 needs a distributed launch .*\(got 6 process"),
        (dict(world=1, ep=2), r"ep_size=2 needs a distributed launch .*\(got 1 process"),
        (dict(world=0), r"ParallelDims.world must be >= 1, got 0"),
        (dict(cp=0), r"ParallelDims.cp must be >= 1, got 0"),
    ],
)
def test_refusals(dims, match):
    with pytest.raises(LongStrawError, match=match):
        ParallelDims(**dims)


def test_from_launch_without_a_process_group_is_one_rank():
    state = SimpleNamespace(num_processes=4, distributed_type=DistributedType.FSDP)
    dims = ParallelDims.from_launch(state)
    assert dims == ParallelDims(world=1, fsdp=True)
    with pytest.raises(LongStrawError, match="cp_size=2 needs a distributed launch"):
        ParallelDims.from_launch(state, cp_size=2)


def test_launched_with_fsdp_reads_accelerates_distributed_type():
    assert launched_with_fsdp(SimpleNamespace(distributed_type=DistributedType.FSDP))
    assert not launched_with_fsdp(SimpleNamespace(distributed_type=DistributedType.MULTI_GPU))
    assert not launched_with_fsdp(SimpleNamespace(distributed_type=DistributedType.NO))
