"""CPU: a real model's forward in fp32 against TRL's default bf16 (CPU autocast), interleaved repetitions.

python bench/cpu_autocast.py --out bench/results/cpu_autocast_smollm2_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from longstraw_trl.pretrained import load_pretrained


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench/results/cpu_autocast_smollm2_cpu.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = load_pretrained(args.model)
    model.eval()
    ids = torch.randint(100, 40000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    seconds = {"fp32": [], "bf16_autocast": []}
    with torch.no_grad():
        for _ in range(args.reps):
            for key in seconds:
                t = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=key != "fp32"):
                    model(ids, logits_to_keep=1)
                seconds[key].append(time.perf_counter() - t)
    median = {k: statistics.median(v) for k, v in seconds.items()}
    print(median)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "median_seconds": median, "seconds": seconds}, f, indent=1)


if __name__ == "__main__":
    main()
