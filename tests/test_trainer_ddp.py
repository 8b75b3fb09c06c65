"""`LongStrawGRPOTrainer` under DDP (2 processes, gloo, CPU).

The response replays call the decoder layers directly, so under DDP they run inside a call of the DDP-wrapped model
(`longstraw_replay=` keyword): DDP then reduces gradients exactly as after an ordinary forward. Checked here on two
micro-batches of one optimizer step (the first under `accelerator.no_sync`, as the Trainer runs it):
- the synchronised gradient equals the average over ranks of the local (unsynchronised) gradients;
- DDP all-reduces once per optimizer step: only the last response's backward of the last micro-batch synchronises.
With the entropy options (bonus, `top_entropy_quantile` with its graph-free entropy pass and cross-rank quantile,
adaptive control) the same holds, and the adaptive controller reduces its window over both ranks. With
`gradient_mode="full"` and reverse block replay, the synchronising backward is the last group's first prompt chunk.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _spawn import as_rank, exit_worker, free_port, run_processes
from _trl_helpers import make_tiny_longstraw_trainer, random_grpo_inputs

from longstraw_trl.state_cache import prompt_key as _prompt_key

LENGTHS = [6, 2, 5, 1]


def _inputs(rank: int, micro: int):
    """Two groups per rank and micro-batch, each with its own prompt; the longest response is in the first group (the
    synchronising backward must still come after the second group's)."""
    rows, prompts = [], []
    for group in range(2):
        inputs, _, _ = random_grpo_inputs(
            LENGTHS if group == 0 else [3, 2, 1, 2],
            seed=100 * rank + 10 * micro + group,
            beta=0.04,
            prompt_len=12 + rank + group,
            max_len=max(LENGTHS),
        )
        prompt = inputs.pop("prompt_ids")[0]
        inputs.pop("prompt_mask")
        prompts.append((_prompt_key(prompt), prompt))
        rows.append(inputs)
    batch = {k: torch.cat([r[k] for r in rows]) for k in rows[0] if k != "num_items_in_batch"}
    batch["longstraw_prompts"] = prompts
    batch["num_items_in_batch"] = torch.tensor(60)  # the same global count on every rank, as TRL gathers it
    return batch


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


ENTROPY = dict(entropy_coef=0.05, top_entropy_quantile=0.5, use_adaptive_entropy=True, entropy_target=10.0)


def _worker(rank: int, world: int, port: int, options: str) -> None:
    as_rank(rank, world, port)
    # "full": gradient_mode="full" with reverse block replay: every backward under no_sync but the last prompt segment
    extra = {"entropy": ENTROPY, "full": dict(gradient_mode="full", replay_block_size=2)}.get(options, {})
    trainer = make_tiny_longstraw_trainer(beta=0.04, loss_type="grpo", ddp_timeout=60, **extra)

    assert trainer.accelerator.num_processes == world
    model = trainer.model
    ddp = trainer.accelerator.prepare_model(model)
    assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
    calls = []

    def counting_allreduce(state, bucket):
        calls.append(bucket.index())
        tensor = bucket.buffer().div_(world)
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])

    ddp.register_comm_hook(None, counting_allreduce)
    model.train()
    micro_batches = [_inputs(rank, 0), _inputs(rank, 1)]

    state = trainer.accelerator.gradient_state

    def reset_controller():  # the same applied coefficient in both passes (it only moves at a step boundary)
        if options == "entropy":
            trainer.entropy_coef, trainer._last_world_entropy, trainer._entropy_window_stats = 0.05, 1.0, None

    # local gradients: the unwrapped model, no reduction
    model.zero_grad()
    reset_controller()
    for k, inputs in enumerate(micro_batches):
        state._set_sync_gradients(k == 1)
        trainer.micro_batch_loss(model, inputs, backward=True)
    local = _grads(model)
    expected = local.clone()
    dist.all_reduce(expected)
    expected /= world

    # through DDP, as the Trainer runs one optimizer step of two micro-batches
    model.zero_grad()
    windows = []
    reset_controller()
    if options == "entropy":
        control = trainer.entropy_control

        def recording(mode, stats):
            windows.append(stats.detach().clone())
            control(mode, stats)

        trainer.entropy_control = recording
    state._set_sync_gradients(False)
    with trainer.accelerator.no_sync(ddp):
        trainer.micro_batch_loss(ddp, micro_batches[0], backward=True)
    assert not calls  # nothing reduced during the first micro-batch
    state._set_sync_gradients(True)
    trainer.micro_batch_loss(ddp, micro_batches[1], backward=True)
    synced = _grads(model)

    assert (local - expected).abs().max() > 1e-6  # the ranks really had different gradients
    torch.testing.assert_close(synced, expected, atol=1e-6, rtol=1e-5)
    assert len(calls) == len(set(calls)) >= 1  # each bucket reduced once: a single synchronising backward
    if options == "entropy":
        local = torch.stack(windows).sum(0)  # this rank's [entropy sum, token count] of the window
        total = local.clone()
        dist.all_reduce(total)
        assert trainer._last_world_entropy == pytest.approx((total[0] / total[1]).item(), rel=1e-6)
        assert abs(trainer._last_world_entropy - (local[0] / local[1]).item()) > 1e-6  # the ranks differ
        assert trainer.entropy_coef == pytest.approx(0.055)  # one update, the same on every rank
    dist.barrier()
    exit_worker()


@pytest.mark.parametrize(
    "options",
    # "full" (120 s here) is slow: the full mode's DDP step through train(), its single-process equality and its one
    # all-reduce per bucket are tests/test_full_gradient_distributed.py's fast test
    ["plain", "entropy", pytest.param("full", marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("world", [2])
def test_ddp_reduces_once_per_optimizer_step_and_averages(world, options):
    run_processes(_worker, (world, free_port(), options), world)
