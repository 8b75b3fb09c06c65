"""One LongStrawGRPOTrainer optimizer step as a script: alone, or under `accelerate launch` with cp_size.

    python tests/_cp_step.py --cp-size 1 --out single.json
    accelerate launch --config_file examples/accelerate/cp2.yaml --mixed_precision no tests/_cp_step.py \
        --cp-size 2 --out cp.json

``--gradient-mode full`` / ``--replay-block-size N`` train with the full gradient / reverse block replay.
``--as-rank R`` samples with rank R's random stream (:class:`DesyncRandomness`) in one process; ``--lora`` trains LoRA adapters (peft) instead of every parameter. Under a launch config with
``distributed_type: FSDP`` (examples/accelerate/fsdp2.yaml) the policy is sharded with FSDP2 (on a CPU-only
machine through :func:`_fsdp_shim.fsdp_on_cpu`); gradients and parameters are then gathered before they are written.
``--family qwen3_moe`` / ``glm_moe_dsa`` trains a tiny MoE (4 / 8 experts) instead of the dense Qwen3; ``--ep-size N``
(with ``--ep-implementation``) splits its experts over EP groups (transformers' EP), ``--router-aux C`` sets the
router load-balancing coefficient. ``--bf16`` trains under TRL's default ``bf16=True`` (on CPU: bf16 autocast; launch with
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
from _models import build_glm_dsa, build_hybrid, build_moe  # noqa: E402
from _trl_helpers import (  # noqa: E402
    TINY_VOCAB,
    make_tiny_longstraw_trainer,
    tiny_qwen3_config,
    tiny_qwen3_moe,
)
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
    ap.add_argument(
        "--model-bf16",
        action="store_true",
        help="the policy's weights in bf16 (as a real model loads): peft's adapters stay fp32 masters",
    )
    ap.add_argument("--prompt", default="the long straw holds a long history. " * 6)
    ap.add_argument("--gradient-mode", default="response_only")
    ap.add_argument("--replay-block-size", type=int, default=None)
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--loss-type", default="dapo")
    ap.add_argument("--as-rank", type=int, default=0)
    ap.add_argument("--beta", type=float, default=0.0, help="KL coefficient (> 0: reference log-probs)")
    ap.add_argument(
        "--save", default=None, help="after the step, trainer.save_model(DIR), reloaded by the main rank"
    )
    ap.add_argument(
        "--family", default="qwen3", choices=["qwen3", "qwen3_5", "qwen3_moe", "glm_moe_dsa", *MOE_FAMILIES]
    )
    ap.add_argument(
        "--generation-gather-gib",
        type=float,
        default=None,
        help="LongStrawGRPOConfig.generation_fsdp_gather_gib (0: FSDP2 gathers every unit per decode token)",
    )
    ap.add_argument("--ep-size", type=int, default=1)
    ap.add_argument("--ep-implementation", default="all_reduce")
    ap.add_argument("--router-aux", type=float, default=0.0, help="router_aux_loss_coef (qwen3_moe)")
    ap.add_argument(
        "--max-grad-norm", type=float, default=0.0, help="> 0: clip (the recorded gradients are clipped)"
    )
    ap.add_argument(
        "--second-trainer",
        action="store_true",
        help="first a step of another trainer on the same model (as bench/full_model.py's warm-up step does)",
    )
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


MOE_FAMILIES = ("glm4_moe", "qwen3_5_moe", "gpt_oss")
"""The other MoE families, built by ``_models.build_moe`` with the toy tokenizer's vocabulary."""


def build_model(family: str, router_aux: float = 0.0):
    """The step's policy, equal on every rank (seed 0): the dense tiny Qwen3, a 2-layer Qwen3-MoE (4 experts, top-2,
    sharpened routers) or a 4-layer GLM-5 (2 dense + 2 MoE layers, 8 routed experts + 1 shared, MLA + DSA with
    ``index_topk`` above the length), each with the toy tokenizer's vocabulary."""
    if family == "qwen3_moe":
        return tiny_qwen3_moe(router_aux_loss_coef=router_aux, seed=0)
    if family in MOE_FAMILIES:
        return build_moe(
            family, seed=0, vocab_size=TINY_VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2
        ).train()
    if (
        family == "qwen3_5"
    ):  # the hybrid GDN family (its _no_split_modules also names the vision tower's block)
        return build_hybrid(
            "qwen3_5", seed=0, vocab_size=TINY_VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2
        ).train()
    if family == "glm_moe_dsa":
        return build_glm_dsa(
            seed=0, vocab_size=TINY_VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2
        ).train()
    torch.manual_seed(0)
    return Qwen3ForCausalLM(tiny_qwen3_config())


def _trainer(a: argparse.Namespace, model, peft):
    return make_tiny_longstraw_trainer(
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
        max_grad_norm=a.max_grad_norm,  # 0: no clipping, the recorded gradients are the raw ones
        bf16=a.bf16,
        gradient_mode=a.gradient_mode,
        replay_block_size=a.replay_block_size,
        peft_config=peft,
        ep_size=a.ep_size,
        ep_implementation=a.ep_implementation,
        generation_fsdp_gather_gib=a.generation_gather_gib,
        **({"router_aux_loss_coef": a.router_aux} if a.family == "qwen3_moe" else {}),
    )


def step(a: argparse.Namespace) -> None:
    peft = None
    if a.lora:
        from peft import LoraConfig

        peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    # built here rather than loaded from `tiny_model_dir()`: under an FSDP launch only the main process saves it
    model = build_model(a.family, a.router_aux)
    if a.model_bf16:
        model.to(torch.bfloat16)
    # --second-trainer: a first trainer's step, then the recorded step by a fresh trainer on its (sharded) model
    if a.second_trainer:
        first = _trainer(a, model, peft)
        first.train()
        model, peft = first.accelerator.unwrap_model(first.model), None
    trainer = _trainer(a, model, peft)
    record = RecordGradients(trainer.model)
    trainer.add_callback(record)
    initial = {
        n: full_tensor(p).detach().double().flatten().tolist() for n, p in trainer.model.named_parameters()
    }
    trainer.add_callback(DesyncRandomness(int(os.environ.get("RANK", 0)) or a.as_rank))
    trainer.train()
    # the expert shards this rank holds (transformers' EP: DTensors on the EP mesh), to show the experts were split
    # and, under FSDP2, the dense parameters' shards: every DTensor's local shape and mesh (its dimension names, size)
    local_shapes = {
        n: list(p.to_local().shape) for n, p in trainer.model.named_parameters() if hasattr(p, "to_local")
    }
    meshes = {
        n: [list(p.device_mesh.mesh_dim_names or []), p.device_mesh.size()]
        for n, p in trainer.model.named_parameters()
        if hasattr(p, "to_local")
    }
    # gathered on every rank (a collective under FSDP2)
    params = {
        n: full_tensor(p).detach().double().flatten().tolist() for n, p in trainer.model.named_parameters()
    }
    saved = None
    if a.save:  # every rank calls it, as the Trainer's checkpointing does; the main process writes
        trainer.save_model(a.save)
        if trainer.accelerator.is_main_process:
            from transformers import AutoModelForCausalLM

            loaded = AutoModelForCausalLM.from_pretrained(a.save, dtype=torch.float32).state_dict()
            saved = {n: t.double().flatten().tolist() for n, t in loaded.items()}
    if trainer.accelerator.is_main_process:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        with open(a.out, "w") as f:
            json.dump(
                {
                    "loss": losses,
                    "grads": record.grads,
                    "params": params,
                    "initial": initial,
                    "local": local_shapes,
                    "meshes": meshes,
                    "grad_norm": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
                    "saved": saved,
                },
                f,
            )
    else:
        with open(f"{a.out}.rank{trainer.accelerator.process_index}", "w") as f:
            json.dump({"grads": record.grads, "local": local_shapes}, f)
    if torch.distributed.is_initialized():  # leave together: a rank that exits early can abort its peer
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
