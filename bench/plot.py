"""Draw bench/results/*.json as bench/results/longstraw_h200.png (needs matplotlib).

    python bench/plot.py

Left: peak memory and prompt-state bytes per rank against P; right: capture seconds against the
attention floor measured in the same run. Stock-TRL comparisons (compare_stock_*.json) are added when
present.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).parent / "results"
GiB = 2**30


def main() -> None:
    fig, (mem, cap) = plt.subplots(1, 2, figsize=(12, 4.5))
    for path in sorted(RESULTS.glob("engine_*.json")):
        data = json.loads(path.read_text())
        label = f"{data.get('preset', path.stem)} x{data['layers']}L"
        ps = [r["prompt_tokens"] / 2**20 for r in data["results"]]
        peak = [max(x["replay_peak_gib"] for x in r["replays"]) for r in data["results"]]
        state = [r["state_bytes"] / GiB for r in data["results"]]
        mem.plot(ps, peak, "o-", label=f"{label}: peak")
        mem.plot(ps, state, "s--", label=f"{label}: state")
        cap.plot(ps, [r["capture_s"] for r in data["results"]], "o-", label=f"{label}: capture")
        cap.plot(
            ps, [r["capture_attention_floor_s"] for r in data["results"]], "x:", label=f"{label}: SDPA floor"
        )
    for path in sorted(RESULTS.glob("cp[0-9]*_*.json")):
        data = json.loads(path.read_text())
        r0 = data["ranks"][0]
        p = data["prompt_tokens"] / 2**20
        mem.plot([p], [r0["replay_peak_gib"]], "D", label=f"CP{data['cp_size']} per rank: peak")
        cap.plot([p], [r0["capture_s"]], "D", label=f"CP{data['cp_size']}: capture")
    for path in sorted(RESULTS.glob("compare_stock_*.json")):
        data = json.loads(path.read_text())
        ok = [r for r in data["results"] if r["stock"].get("ok")]
        mem.plot(
            [r["prompt_tokens"] / 2**20 for r in ok],
            [r["stock"]["peak_gib"] for r in ok],
            "k^-",
            label="stock",
        )
    mem.set(xlabel="prompt tokens (Mi)", ylabel="GiB", title="H200: peak memory and state (R=2048, G=8)")
    cap.set(xlabel="prompt tokens (Mi)", ylabel="seconds", title="capture time vs attention floor")
    for ax in (mem, cap):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = RESULTS / "longstraw_h200.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
