"""Stock GRPOTrainer, gradient_mode="full" and the default response-only mode on the locker task, same budget (CPU).

    python bench/real_modes.py --seeds 0 1 2 --steps 6 --threads 1 --out bench/results/real_modes_smollm2_cpu.json

Every run: SmolLM2-135M-Instruct, LoRA r=16 on every linear layer, fp32, one thread, the task of
examples/grpo_lockers.py (``--facts`` facts per document), the same data order and seed for the three trainers; it
records the training reward of every step and the wall time of every step (generation included). The stock trainer
prefills every prompt for each of its G completions with autograd, so its steps cost far more on long prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import grpo_lockers as demo  # noqa: E402
from _common import use_threads  # noqa: E402

from longstraw_trl.pretrained import load_pretrained  # noqa: E402


class StepTimes(TrainerCallback):
    def __init__(self):
        self.times, self._t = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._t)


def stock_trainer(args, model, tokenizer, rows):
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    dataset = Dataset.from_list([{"prompt": r["doc"] + r["question"], "answer": r["answer"]} for r in rows])
    config = GRPOConfig(
        output_dir=args.output_dir,
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=args.seed,
        shuffle_dataset=False,
        per_device_train_batch_size=args.num_generations * args.questions_per_step,
        num_generations=args.num_generations,
        gradient_accumulation_steps=1,
        max_completion_length=args.completion_tokens,
        temperature=args.temperature,
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        loss_type="dapo",
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        activation_checkpointing=not args.no_activation_checkpointing,  # main() turns it off
    )
    lora = LoraConfig(
        r=args.lora_rank,
        lora_alpha=2 * args.lora_rank,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=demo.locker_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
    )
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    return trainer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--modes", nargs="+", default=["stock", "full", "response_only"])
    ap.add_argument("--out", default="bench/results/real_modes_smollm2_cpu.json")
    own, rest = ap.parse_known_args(argv)
    # like for like: no activation checkpointing in any of the three (gradient_mode="full" fails with TRL's default
    # checkpointing on this model and LoRA: torch's CheckpointError, "a different number of tensors was saved")
    rest = rest + ["--no-activation-checkpointing"]
    warnings.filterwarnings("ignore")
    results = []
    for seed in own.seeds:
        for mode in own.modes:
            args = demo.parse_args(
                rest + ["--seed", str(seed), "--output-dir", f"/tmp/longstraw_real_modes_{mode}"]
            )
            use_threads(args.threads)
            torch.manual_seed(seed)
            model, tokenizer = load_pretrained(args.model)
            n_docs = -(-args.steps * args.questions_per_step // args.questions_per_doc)
            rows = demo.make_split(n_docs, args.questions_per_doc, args, seed=1000 + seed)
            timer = StepTimes()
            if mode == "stock":
                trainer = stock_trainer(args, model, tokenizer, rows)
            else:
                args.gradient_mode = mode
                trainer = demo.build_trainer(args, model, tokenizer, rows)
            trainer.add_callback(timer)
            trainer.train()
            logs = [h for h in trainer.state.log_history if "reward" in h]
            result = {
                "mode": mode,
                "seed": seed,
                "reward_curve": [h["reward"] for h in logs],
                "step_seconds": timer.times,
                "prompt_tokens": demo.token_ids(tokenizer, rows[0]["doc"] + rows[0]["question"]).numel(),
                "args": vars(args),
            }
            results.append(result)
            print(
                f"seed {seed} {mode:>13}: reward {[round(r, 2) for r in result['reward_curve']]}, "
                f"s/step {[round(t, 1) for t in timer.times]}",
                flush=True,
            )
            os.makedirs(os.path.dirname(own.out), exist_ok=True)
            with open(own.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
