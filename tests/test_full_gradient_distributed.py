"""``gradient_mode="full"`` through ``trainer.train()`` on several processes (gloo, CPU) and under bf16.

- DDP, 2 processes: an SGD step of our trainer, each rank a different prompt group, equal the single-process stock
  ``GRPOTrainer`` on both groups (TRL's own full-sequence gradient, same scripted completions); and DDP all-reduces
  every gradient bucket exactly once per optimizer step, in the last group's prompt backward (a comm hook counts the
  reductions: a replay that synchronised too, or a prompt backward that did not, fails here).
- bf16 (TRL's default ``bf16=True``: CPU autocast): an SGD step against stock ``GRPOTrainer`` in bf16.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from _spawn import as_rank, exit_worker, free_port, run_processes
from _trl_helpers import scripted_trainer, tiny_model_dir
from transformers import TrainerCallback

# equal length under the character-level toy tokenizer: one batch of both needs no left padding (stock TRL's
# forward would then shift the positions of the shorter prompt, ours captures each prompt unpadded)
PROMPTS = ("the cat sat on the mat and ran", "a dog ran far away from it all")
# one optimizer step of two groups (one per rank under DDP)
STEPS = dict(max_steps=1, num_iterations=1, prompts=PROMPTS)


class CountReductions(TrainerCallback):
    """Register a comm hook on the DDP-wrapped model when training starts; ``per_step``: the indices of the buckets
    all-reduced in each optimizer step."""

    def __init__(self, trainer):
        self.trainer, self.calls, self.per_step = trainer, [], []

    def on_train_begin(self, args, state, control, **kwargs):
        ddp = self.trainer.model_wrapped
        assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
        world = dist.get_world_size()

        def counting_allreduce(_, bucket):
            self.calls.append(bucket.index())
            tensor = bucket.buffer().div_(world)
            return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])

        ddp.register_comm_hook(None, counting_allreduce)

    def on_step_end(self, args, state, control, **kwargs):
        self.per_step.append(self.calls)
        self.calls = []


def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    tiny_model_dir()  # saved before the process joins a group (a non-main rank's save_pretrained writes no weights)
    as_rank(rank, world, port)
    # prompts of 30 tokens in chunks of 16: the prompt backward recomputes two segments, the synchronising one last
    trainer = scripted_trainer(False, capture_chunk_size=16, ddp_timeout=60, **STEPS)
    assert trainer.accelerator.num_processes == world
    counter = CountReductions(trainer)
    trainer.add_callback(counter)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    if rank == 0:
        update = {n: (p.detach() - start[n]).flatten().tolist() for n, p in trainer.model.named_parameters()}
        with open(out, "w") as f:
            json.dump({"update": update, "reductions": counter.per_step}, f)
    dist.barrier()
    exit_worker()


def _stock_update(**overrides) -> dict[str, torch.Tensor]:
    stock = scripted_trainer(True, **overrides)
    start = {n: p.detach().clone() for n, p in stock.model.named_parameters()}
    stock.train()
    return {n: p.detach() - start[n] for n, p in stock.model.named_parameters()}


def test_ddp_full_gradient_train_equals_single_process_stock_and_reduces_once(tmp_path):
    out = tmp_path / "rank0.json"
    run_processes(_ddp_worker, (2, free_port(), str(out)), 2)
    result = json.loads(out.read_text())
    # one process with both ranks' rows: stock GRPOTrainer, both groups in one micro-batch
    stock = _stock_update(per_device_train_batch_size=8, **STEPS)
    scale = max(u.abs().max() for u in stock.values())
    assert scale > 1e-3  # the steps moved the weights
    worst = 0.0
    for name, ref in stock.items():
        got = torch.tensor(result["update"][name]).reshape(ref.shape)
        worst = max(worst, float((got - ref).norm() / ref.norm().clamp_min(1e-12)))
        torch.testing.assert_close(got, ref, atol=1e-5 * scale, rtol=1e-5, msg=name)
    print(f"DDP full vs single-process stock: worst update rel L2 {worst:.2e}")
    reductions = result["reductions"]
    assert len(reductions) == 1
    for calls in reductions:  # every bucket once per optimizer step: one synchronising backward
        assert calls and len(calls) == len(set(calls)), calls


def _update_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """The worst relative L2 over the parameters of one update against another."""
    return max(float((got[n] - r).norm() / r.norm().clamp_min(1e-12)) for n, r in ref.items())


def test_bf16_full_gradient_train_is_close_to_stock_bf16():
    """TRL's default `bf16=True` (CPU autocast: bf16 matmuls, fp32 weights; our prompt backward runs under the same
    autocast): an SGD step in full mode against stock GRPOTrainer's in bf16. The bound is relative to how far bf16
    moves the stock update itself: both sides round differently (our chunks, merges and replays are other bf16 GEMMs
    than one full forward), so ours may differ from stock-bf16 by at most twice stock's own bf16 error (stock-bf16
    vs stock-fp32); the response-only objective, which drops the prompt's gradient, lies well outside that bound."""
    one_step = dict(max_steps=1, num_iterations=1)
    stock_fp32 = _stock_update(**one_step)
    stock_bf16 = _stock_update(bf16=True, **one_step)
    ours = scripted_trainer(False, bf16=True, **one_step)
    start = {n: p.detach().clone() for n, p in ours.model.named_parameters()}
    ours.train()
    assert ours.args.bf16 and ours.state.global_step == 1
    ours_bf16 = {n: p.detach() - start[n] for n, p in ours.model.named_parameters()}
    bf16_noise = _update_error(stock_bf16, stock_fp32)
    assert bf16_noise > 0  # autocast really ran in bf16
    error = _update_error(ours_bf16, stock_bf16)
    print(f"bf16: ours vs stock {error:.2e}; stock bf16 vs fp32 {bf16_noise:.2e}")
    assert error <= 2 * bf16_noise
