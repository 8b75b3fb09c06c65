"""A short table of full_model.py JSONs' full-mode prompt backward: seconds against both floors, segment times and
the profiled segment's kernel families and top kernels (what a device command prints last). A step the command's
timeout cut during its prompt backward (its entry still "running") gets an estimate of the whole prompt backward:
the segments it timed, plus the rest from a line fitted to them (a segment's seconds grow linearly with the pages
before it: the page attention), labelled as such.

    python bench/pb_summary.py "bench/results/full_model_*_offload*.json"
"""

from __future__ import annotations

import glob
import json
import statistics
import sys

from engine_slice import full_attention_layers, slice_config
from full_model import prompt_backward_floor_s


def estimate_cut_prompt_backward(data: dict, entry: dict) -> dict | None:
    """For ``entry`` (a step of ``data``) cut during its prompt backward: the timed segments' seconds, the untimed
    ones' from the line through the timed ones (seconds against first token), their sum, and the floors of the
    whole prompt backward at the run's rates. ``None`` when fewer than two segments were timed."""
    part = entry.get("partial") or {}
    seconds, starts = part.get("segment_s") or [], part.get("segment_start_tokens") or []
    if len(seconds) < 2 or len(seconds) != len(starts):
        return None
    fit = statistics.linear_regression(starts, seconds)
    chunk, p = data["capture_chunk_size"], entry["prompt_tokens"]
    untimed = [s for s in range(0, min(starts), chunk)]
    predicted = [fit.intercept + fit.slope * s for s in untimed]
    params, rates = data["params"], data["rates"]
    per_pair = params.get("attention_heads_x_head_dim_x_layers")
    if per_pair is None:  # JSONs written before the params recorded it
        config = slice_config(data["preset"], data["layers"], 1024)
        per_pair = config.num_attention_heads * config.head_dim * full_attention_layers(config)
    floor = [params["decoder_params"], params["lora_params"], per_pair, rates["matmul_tflops"] * 1e12]
    total = sum(seconds) + sum(predicted)
    at_forward = prompt_backward_floor_s(p, *floor, rates["attention_tflops"] * 1e12)
    at_kernels = prompt_backward_floor_s(
        p, *floor, rates["attention_tflops"] * 1e12, rates["attention_backward_tflops"] * 1e12
    )
    return {
        "segments_timed": len(seconds),
        "segments_estimated": len(untimed),
        "timed_s": sum(seconds),
        "estimated_rest_s": sum(predicted),
        "prompt_backward_estimate_s": total,
        "fit_seconds_at_token_0": fit.intercept,
        "fit_seconds_per_page": fit.slope * data["page_size"],
        "floor_s": at_forward,
        "floor_at_kernel_rates_s": at_kernels,
        "estimate_over_floor": total / at_forward,
        "estimate_over_floor_at_kernel_rates": total / at_kernels,
        "phases_before_s": {k: sum(v) for k, v in part.items() if k.endswith("_seconds")},
    }


def summarise(path: str) -> None:
    data = json.load(open(path))
    print(
        path,
        data.get("device"),
        data.get("git_revision"),
        "bwd rate",
        data["rates"].get("attention_backward_tflops"),
    )
    for r in [data.get("longstraw_warmup"), *data["longstraw"]]:
        cut = r and r.get("status") == "running" and estimate_cut_prompt_backward(data, r)
        if cut:
            print(
                f"P={r['prompt_tokens']} {r['gradient_mode']} cut by the timeout in its prompt backward:", cut
            )
        if not r or not r.get("ok"):
            continue
        pb = r.get("phases", {}).get("prompt_backward") or {}
        print(
            f"P={r['prompt_tokens']} {r['gradient_mode']} train {r['train_s']:.1f}s peak {r.get('peak_gib') or 0:.1f} GiB "
            f"(plan {r['planner']['peak_gib']:.1f}) pb {pb.get('seconds', 0):.1f}s over floor "
            f"{pb.get('over_floor') or 0:.2f}, at kernel rates {pb.get('over_floor_at_kernel_rates') or 0:.2f}"
        )
        if r.get("segment_s"):
            print("  segments", r["segment_s"])
        prof = r.get("segment_profile")
        if prof:
            print(
                f"  segment {prof['segment_index']}: wall {prof['wall_s']:.2f}s busy {prof['device_busy_share']:.2f}"
            )
            for name, fam in sorted(prof["families"].items(), key=lambda kv: -kv[1]["self_s"]):
                print(f"    {name:12s} {fam['self_s']:.3f}s {fam['calls']}")
            for k in prof["top_kernels"][:25]:
                print(f"    {k['self_s']:.3f}s {k['calls']:6d} {k['name'][:100]}")
            for o in prof.get("top_ops", [])[:15]:
                print(f"    op {o['self_s']:.3f}s {o['calls']:6d} {o['op']} {o['shapes'][:80]}")


if __name__ == "__main__":
    for p in sorted(glob.glob(sys.argv[1])):
        summarise(p)
