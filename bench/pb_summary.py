"""A short table of full_model.py JSONs' full-mode prompt backward: seconds against both floors, segment times and
the profiled segment's kernel families and top kernels (what a device command prints last).

    python bench/pb_summary.py "bench/results/full_model_*session20*.json"
"""

from __future__ import annotations

import glob
import json
import sys


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
