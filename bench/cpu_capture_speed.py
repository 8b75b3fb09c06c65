"""CPU: the capture against HF's prefill on a real model, with the CPU flash path on and off (interleaved runs).

    python bench/cpu_capture_speed.py --lengths 1024 2048 --out bench/results/cpu_capture_speed_smollm2_cpu.json

Each repetition times, in this order: HF's forward over the prompt (``model(ids, logits_to_keep=1)``, no grad), the
capture with the CPU flash path on, and with it off (``LONGSTRAW_DISABLE=cpu_flash``, the plain-math path). Medians over the repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from longstraw_trl import capture_prompt
from longstraw_trl.pretrained import load_pretrained


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench/results/cpu_capture_speed_smollm2_cpu.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = load_pretrained(args.model)
    model.eval()
    rows = []
    for length in args.lengths:
        ids = torch.randint(100, 40000, (length,), generator=torch.Generator().manual_seed(length))
        times = {"hf_prefill": [], "capture_cpu_flash": [], "capture_plain_math": []}
        with torch.no_grad():
            for _ in range(args.reps):
                t = time.perf_counter()
                model(ids[None], logits_to_keep=1)
                times["hf_prefill"].append(time.perf_counter() - t)
                for key, off in (("capture_cpu_flash", ""), ("capture_plain_math", "cpu_flash")):
                    os.environ["LONGSTRAW_DISABLE"] = off
                    t = time.perf_counter()
                    capture_prompt(model, ids, chunk_size=8192)
                    times[key].append(time.perf_counter() - t)
        os.environ.pop("LONGSTRAW_DISABLE", None)
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"prompt_tokens": length, "median_seconds": med, "seconds": times}
        row["capture_over_prefill"] = {
            k: med[k] / med["hf_prefill"] for k in ("capture_cpu_flash", "capture_plain_math")
        }
        rows.append(row)
        print(length, {k: round(v, 2) for k, v in med.items()}, row["capture_over_prefill"], flush=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "model": args.model,
                "args": vars(args),
                "attn_implementation": model.config._attn_implementation,
                "rows": rows,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
