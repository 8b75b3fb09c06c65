"""One LongStrawGRPOTrainer optimizer step as a script: alone, or under `accelerate launch` with cp_size.

    python tests/_cp_step.py --cp-size 1 --out single.json
    accelerate launch --config_file examples/accelerate/cpu_2proc.yaml tests/_cp_step.py --cp-size 2 --out cp.json

Rank 0 writes the logged loss and every parameter after the step (the CP test compares the two files).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _trl_helpers import make_tiny_longstraw_trainer  # noqa: E402
from datasets import Dataset  # noqa: E402


def length_reward(completions, **kwargs):
    return [len(c) / 16.0 for c in completions]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cp-size", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    prompt = "the long straw holds a long history. " * 6
    trainer = make_tiny_longstraw_trainer(
        loss_type="dapo",
        cp_size=a.cp_size,
        train_dataset=Dataset.from_dict({"prompt": [prompt] * 8}),
        reward_funcs=length_reward,
        max_steps=1,
        gradient_accumulation_steps=1,
        capture_chunk_size=64,
        page_size=32,
        seed=0,
    )
    trainer.train()
    if trainer.accelerator.is_main_process:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        params = {n: p.detach().double().flatten().tolist() for n, p in trainer.model.named_parameters()}
        with open(a.out, "w") as f:
            json.dump({"loss": losses, "params": params}, f)


if __name__ == "__main__":
    main()
