"""Context parallelism over prompt pages (gloo, CPU): equal to the single-process engine.

Also under CPU bf16 autocast (TRL's default ``bf16=True``), where the page partials are bf16, with a rank
that holds no pages; and the all-gather merge itself, which must ignore empty partials without a host sync.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from _models import build
from _reference import weighted_replay_grads
from _spawn import exit_worker, run_processes

from longstraw_trl import capture_prompt, generate_from_state, replay_logprobs
from longstraw_trl.context_parallel import merge_gathered
from longstraw_trl.kernels.attention import attention_lse, merge_partials


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
        diff = (replay_logprobs(single, model, ids, mask) - replay_logprobs(sharded, model, ids, mask)) * mask
        assert diff.abs().max() <= 1e-5, diff.abs().max()

        # gradients: equal to one process, and identical on every rank
        g_single = weighted_replay_grads(model, single, ids, mask)
        g_cp = weighted_replay_grads(model, sharded, ids, mask)
        assert (g_cp - g_single).norm() / g_single.norm() <= 1e-5
        gathered = [torch.empty_like(g_cp) for _ in range(world)]
        dist.all_gather(gathered, g_cp)
        assert all(torch.equal(gathered[0], g) for g in gathered)

        # generation reads the sharded pages too
        a = generate_from_state(single, model, 2, 6, do_sample=False)
        b = generate_from_state(sharded, model, 2, 6, do_sample=False)
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


def _bf16_worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        model = build("qwen3")
        # a one-rank CP group per rank (new_group is collective: every rank creates all of them)
        alone_group = [dist.new_group([r]) for r in range(world)][rank]
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, 97, (3,), generator=gen)  # shorter than one page: only rank 0 owns pages
        ids = torch.randint(0, 97, (3, 7), generator=gen)
        mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5])
        with torch.autocast("cpu", dtype=torch.bfloat16):  # what accelerate does for bf16=True on CPU
            kw = dict(chunk_size=8, page_size=4)
            single = capture_prompt(model, prompt, **kw)
            alone = capture_prompt(model, prompt, cp_group=alone_group, **kw)
            sharded = capture_prompt(model, prompt, cp_group=dist.group.WORLD, **kw)
            assert (sharded.nbytes() > 0) == (rank == 0), sharded.nbytes()  # (qwen3: K/V pages only)
            lp = {
                n: replay_logprobs(st, model, ids, mask) * mask
                for n, st in [("1", single), ("a", alone), ("s", sharded)]
            }
            grads = {
                n: weighted_replay_grads(model, st, ids, mask)
                for n, st in [("1", single), ("a", alone), ("s", sharded)]
            }
            tokens = {
                n: generate_from_state(st, model, 2, 6, do_sample=False)
                for n, st in [("a", alone), ("s", sharded)]
            }
        # the empty rank's partial weighs exactly 0: equal to one rank with the same fp32 merge, bit for bit
        assert torch.equal(lp["s"], lp["a"])
        assert torch.equal(grads["s"], grads["a"])
        assert torch.equal(tokens["s"], tokens["a"])
        # and to the plain single-process engine up to bf16 rounding (its prompt part stays bf16)
        assert (lp["s"] - lp["1"]).abs().max() <= 5e-2, (lp["s"] - lp["1"]).abs().max()
        assert (grads["s"] - grads["1"]).norm() / grads["1"].norm() <= 5e-2
        gathered = [torch.empty_like(grads["s"]) for _ in range(world)]
        dist.all_gather(gathered, grads["s"])
        assert all(torch.equal(gathered[0], g) for g in gathered)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_worker()


def test_context_parallel_bf16_autocast_with_a_rank_without_pages():
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        run_processes(_bf16_worker, (2, init_file), 2)


def _empty(like_out: torch.Tensor, like_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros_like(like_out), torch.full_like(like_lse, float("-inf"))


def test_merge_gathered_is_exact_with_empty_partials():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, 8, generator=gen)
    k = torch.randn(2, 3, 19, 8, generator=gen)
    v = torch.randn(2, 3, 19, 8, generator=gen)
    whole = attention_lse(q, k, v, 0.3)
    a = attention_lse(q, k[..., :7, :], v[..., :7, :], 0.3)
    c = attention_lse(q, k[..., 7:, :], v[..., 7:, :], 0.3)
    e = _empty(*a)
    ref = merge_gathered([a[0], c[0]], [a[1], c[1]])
    for o, s in zip(ref, whole, strict=True):
        torch.testing.assert_close(o, s, rtol=1e-5, atol=1e-6)
    for o, s in zip(ref, merge_partials(*a, *c), strict=True):
        torch.testing.assert_close(o, s, rtol=1e-5, atol=1e-6)
    # an empty partial anywhere in the list changes nothing, bit for bit
    for parts in ([a, e, c], [e, a, c], [a, c, e], [e, a, e, c]):
        got = merge_gathered([p[0] for p in parts], [p[1] for p in parts])
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    # rows empty in every partial: out 0, lse -inf, no NaN; the other rows as without those partials
    a_rows = (a[0].clone(), a[1].clone())
    a_rows[0][:, :, :2] = 0.0
    a_rows[1][:, :, :2] = float("-inf")
    got = merge_gathered([e[0], a_rows[0], e[0]], [e[1], a_rows[1], e[1]])
    assert not got[0].isnan().any() and not got[1].isnan().any()
    assert torch.equal(got[0][:, :, :2], torch.zeros_like(got[0][:, :, :2]))
    assert torch.isneginf(got[1][:, :, :2]).all()
    assert torch.equal(got[0][:, :, 2:], a[0][:, :, 2:]) and torch.equal(got[1][:, :, 2:], a[1][:, :, 2:])
    out, lse = merge_gathered([e[0], e[0]], [e[1], e[1]])
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
