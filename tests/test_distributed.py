"""Context parallelism over prompt pages (gloo, CPU): equal to the single-process engine."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from _models import build
from _spawn import exit_worker, run_processes

from longstraw_trl import capture_prompt


def _grads(model, state, ids, mask):
    model.zero_grad()
    for i in range(ids.shape[0]):
        n = int(mask[i].sum())
        w = torch.linspace(-1, 1, n)
        (state.logprobs(model, ids[i : i + 1, :n], grad=True)[0] * w).sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _worker(rank: int, world: int, init_file: str, family: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        model = build(family)
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, 97, (45,), generator=gen)
        ids = torch.randint(0, 97, (3, 7), generator=gen)
        mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5])
        page = 4
        single = capture_prompt(model, prompt, chunk_size=8, page_size=page)
        sharded = capture_prompt(model, prompt, chunk_size=8, page_size=page, cp_group=dist.group.WORLD)

        # state: each rank holds its round-robin share of pages, within one page of total / world
        per_token = single.nbytes() // 45
        assert abs(sharded.nbytes() - single.nbytes() / world) <= page * per_token
        total = torch.tensor([sharded.nbytes()])
        dist.all_reduce(total)
        assert int(total) == single.nbytes()

        # log-probs
        diff = (single.logprobs(model, ids, mask) - sharded.logprobs(model, ids, mask)) * mask
        assert diff.abs().max() <= 1e-5, diff.abs().max()

        # gradients: equal to one process, and identical on every rank
        g_single = _grads(model, single, ids, mask)
        g_cp = _grads(model, sharded, ids, mask)
        assert (g_cp - g_single).norm() / g_single.norm() <= 1e-5
        gathered = [torch.empty_like(g_cp) for _ in range(world)]
        dist.all_gather(gathered, g_cp)
        assert all(torch.equal(gathered[0], g) for g in gathered)

        # generation reads the sharded pages too
        a = single.generate(model, 2, 6, do_sample=False)
        b = sharded.generate(model, 2, 6, do_sample=False)
        assert torch.equal(a, b)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_worker()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("family", ["qwen3"])
def test_context_parallel_equals_single_process(world, family):
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        run_processes(_worker, (world, init_file, family), world)
