"""Draw bench/results/*.json as bench/results/plot_slices_h200.png (needs matplotlib).

    python bench/plot.py

Left: peak memory against P, stock TRL and LongStraw (compare_stock_*.json, where stock's OOM is marked
with an x on the device-memory line) and the engine sweeps (engine_*.json). Middle: the training work of
one GRPO step (G completions, generation excluded) against P, both sides; hollow markers are stock times
projected from fewer sequences. Right: the engine sweep's capture, generation and replay seconds against
their floors measured in the same run.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from longstraw_trl.planner import GPU_MEMORY_GIB  # noqa: E402

RESULTS = Path(__file__).parent / "results"
GiB = 2**30
COLORS = {"qwen3-8b": "tab:blue", "qwen3.6-27b": "tab:red"}


def _load(pattern: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(RESULTS.glob(pattern))]


def _rank(r: dict) -> int:
    return 2 if r.get("ok") else 1 if r.get("oom") else 0  # measured > ran out of memory > not run


def _merged_compare() -> dict[str, list[tuple[int, dict, dict]]]:
    """preset -> [(P, stock, longstraw)]: per side, the first run that measured it (or saw it OOM)."""
    rows: dict[str, dict[int, list[dict]]] = defaultdict(dict)
    for data in _load("compare_stock_*.json"):
        for r in data["results"]:
            best = rows[data["preset"]].setdefault(r["prompt_tokens"], [r["stock"], r["longstraw"]])
            for i, side in enumerate((r["stock"], r["longstraw"])):
                if _rank(side) > _rank(best[i]):
                    best[i] = side
    return {k: sorted((p, s, o) for p, (s, o) in v.items()) for k, v in rows.items()}


def main() -> None:
    fig, (mem, step, sweep) = plt.subplots(1, 3, figsize=(17, 4.8))
    gpu = GPU_MEMORY_GIB["h200"]
    mem.axhline(gpu, color="gray", ls="--", lw=1)
    mem.text(2**15, gpu * 1.03, "H200 memory", fontsize=7, color="gray")

    for preset, rows in _merged_compare().items():
        c = COLORS.get(preset, "k")
        ok = [(p, s) for p, s, _ in rows if s.get("ok")]
        mem.plot(
            [p for p, _ in ok], [s["peak_gib"] for _, s in ok], "^-", color=c, label=f"{preset}: stock TRL"
        )
        oom = [p for p, s, _ in rows if s.get("oom")]
        mem.plot(oom, [gpu] * len(oom), "x", color=c, ms=11, mew=2, label=f"{preset}: stock OOM")
        ours = [(p, o) for p, _, o in rows if o.get("ok")]
        mem.plot(
            [p for p, _ in ours],
            [o["peak_gib"] for _, o in ours],
            "o-",
            color=c,
            label=f"{preset}: LongStraw",
        )
        full = [(p, s["step_s"]) for p, s, _ in rows if "step_s" in s]
        proj = [(p, s["step_s_projected"]) for p, s, _ in rows if "step_s_projected" in s]
        step.plot(*zip(*full, strict=True), "^-", color=c, label=f"{preset}: stock TRL")
        if proj:
            step.plot(
                *zip(*proj, strict=True), "^", color=c, mfc="none", ms=9, label=f"{preset}: stock (projected)"
            )
        step.plot(
            [p for p, _ in ours], [o["step_s"] for _, o in ours], "o-", color=c, label=f"{preset}: LongStraw"
        )

    sweeps: dict[str, list[dict]] = defaultdict(list)
    for data in _load("engine_*.json"):
        if "generation" in data["results"][0]:  # sweeps with every floor (this revision's engine_slice.py)
            sweeps[f"{data['preset']} x{data['layers']}L"].extend(data["results"])
    for label, results in sweeps.items():
        results.sort(key=lambda r: r["prompt_tokens"])
        ps = [r["prompt_tokens"] for r in results]
        mem.plot(
            ps,
            [max(x["replay_peak_gib"] for x in r["replays"]) for r in results],
            "s:",
            color="tab:red",
            label=f"{label}: LongStraw engine",
        )
        mem.plot(
            ps, [r["state_bytes"] / GiB for r in results], "s:", color="tab:orange", label=f"{label}: state"
        )
        for key, floor, color, name in (
            (
                lambda r: r["capture_s"],
                lambda r: r.get("capture_floor_s_without_head", r["capture_floor_s"]),
                "tab:red",
                "capture",
            ),
            (
                lambda r: r["generation"]["generation_s"],
                lambda r: r["generation"]["generation_floor_s"],
                "tab:green",
                "generation (G=8)",
            ),
            (
                lambda r: r["replays"][-1]["replay_s_per_response"],
                lambda r: r["replay_floor_s"],
                "tab:purple",
                "replay / response",
            ),
        ):
            sweep.plot(ps, [key(r) for r in results], "o-", color=color, label=f"{name}")
            sweep.plot(ps, [floor(r) for r in results], "x:", color=color, label=f"{name} floor")
        sweep.set_title(f"{label}: time vs floor (H200)", fontsize=10)

    mem.set(ylabel="GiB", title="peak memory per GPU, 4-layer slices (G=8, R=2048)")
    step.set(ylabel="seconds", title="GRPO step without generation, 4-layer slices")
    sweep.set(ylabel="seconds")
    for ax in (mem, step, sweep):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens P")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5)
    step.set_yscale("log")
    sweep.set_yscale("log")
    fig.tight_layout()
    out = RESULTS / "plot_slices_h200.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
