"""One LongStrawGRPOTrainer optimizer step as a script: alone, or under `accelerate launch` with cp_size.

    python tests/_cp_step.py --cp-size 1 --out single.json
    accelerate launch --config_file examples/accelerate/cp2.yaml --mixed_precision no tests/_cp_step.py \
        --cp-size 2 --out cp.json

``--gradient-mode full`` / ``--replay-block-size N`` train with the full gradient / reverse block replay.
``--as-rank R`` samples with rank R's random stream (:class:`DesyncRandomness`) in one process; ``--lora`` trains LoRA adapters (peft) instead of every parameter. Under a launch config with
``distributed_type: FSDP`` (examples/accelerate/fsdp2.yaml) the policy is sharded with FSDP2 (on a CPU-only
machine through :func:`_fsdp_shim.fsdp_on_cpu`); gradients and parameters are then gathered before they are written.
``--bf16`` trains under TRL's default ``bf16=True`` (on CPU: bf16 autocast; launch with
``--mixed_precision bf16`` then); ``--prompt`` replaces the default ~7-page prompt (a prompt shorter than
one 32-token page leaves every rank but the first without pages).

Rank 0 writes the logged loss, every parameter's gradient just before the optimizer step (clipping off)
and every parameter after it; each other rank writes its gradients to ``<out>.rank<N>`` (the CP test
compares the files: the gradients are what CP must get right; a one-step update at TRL's learning rate
of 1e-6 moves the parameters too little to tell).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _fsdp_shim import fsdp_on_cpu, full_tensor  # noqa: E402
from _trl_helpers import make_tiny_longstraw_trainer, tiny_qwen3_config  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import Qwen3ForCausalLM, TrainerCallback  # noqa: E402


class DesyncRandomness(TrainerCallback):
    """Give every non-first rank its own RNG stream: a CP group must stay in step without relying on equal seeds
    (sampled tokens and the group order come from the first rank); data-parallel ranks sample their own completions.
    ``rank``: this process's rank, or the rank a single process plays (``--as-rank``)."""

    def __init__(self, rank: int):
        self.rank = rank

    def on_step_begin(self, args, state, control, **kwargs):
        if self.rank:
            torch.manual_seed(1000 + self.rank)


class RecordGradients(TrainerCallback):
    """The gradients the optimizer is about to apply (after the backward of every micro-batch)."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads = {
            n: full_tensor(p.grad).detach().double().flatten().tolist()
            for n, p in self.model.named_parameters()
            if p.grad is not None
        }


def length_reward(completions, **kwargs):
    return [len(c) / 16.0 for c in completions]


def main(argv: list[str] | None = None) -> None:
    """One step as the arguments say; run in the test's own process when not launched (``argv``)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--cp-size", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--prompt", default="the long straw holds a long history. " * 6)
    ap.add_argument("--gradient-mode", default="response_only")
    ap.add_argument("--replay-block-size", type=int, default=None)
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--loss-type", default="dapo")
    ap.add_argument("--as-rank", type=int, default=0)
    ap.add_argument("--beta", type=float, default=0.0, help="KL coefficient (> 0: reference log-probs)")
    a = ap.parse_args(argv)
    fsdp_on_cpu()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step(a)
    finally:
        torch.set_num_threads(threads)


def step(a: argparse.Namespace) -> None:
    peft = None
    if a.lora:
        from peft import LoraConfig

        peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    # built here rather than loaded from `tiny_model_dir()`: under an FSDP launch only the main process saves it
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_qwen3_config())
    trainer = make_tiny_longstraw_trainer(
        model=model,
        loss_type=a.loss_type,
        beta=a.beta,
        cp_size=a.cp_size,
        train_dataset=Dataset.from_dict({"prompt": [a.prompt] * 16}),
        reward_funcs=length_reward,
        max_steps=1,
        per_device_train_batch_size=16,  # four groups per micro-batch: their order must agree across CP ranks
        num_generations=4,
        gradient_accumulation_steps=1,
        capture_chunk_size=64,
        page_size=32,
        seed=0,
        max_grad_norm=0.0,  # no clipping: the recorded gradients are the raw ones
        bf16=a.bf16,
        gradient_mode=a.gradient_mode,
        replay_block_size=a.replay_block_size,
        peft_config=peft,
    )
    record = RecordGradients(trainer.model)
    trainer.add_callback(record)
    initial = {
        n: full_tensor(p).detach().double().flatten().tolist() for n, p in trainer.model.named_parameters()
    }
    trainer.add_callback(DesyncRandomness(int(os.environ.get("RANK", 0)) or a.as_rank))
    trainer.train()
    # gathered on every rank (a collective under FSDP2)
    params = {
        n: full_tensor(p).detach().double().flatten().tolist() for n, p in trainer.model.named_parameters()
    }
    if trainer.accelerator.is_main_process:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        with open(a.out, "w") as f:
            json.dump({"loss": losses, "grads": record.grads, "params": params, "initial": initial}, f)
    else:
        with open(f"{a.out}.rank{trainer.accelerator.process_index}", "w") as f:
            json.dump({"grads": record.grads}, f)
    if torch.distributed.is_initialized():  # leave together: a rank that exits early can abort its peer
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
