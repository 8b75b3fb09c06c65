"""Draw the real-model results as bench/results/real_modes_smollm2_cpu.png (needs matplotlib).

    python bench/plot_real.py

Left: training reward per step of stock GRPOTrainer, gradient_mode="full" and the response-only default
(real_modes_smollm2_cpu.json; thin lines: seeds, thick: their mean). Middle: seconds per step of each. Right: cosine of
the response-only gradient to the full one against the prompt length (real_cosine_smollm2*.json; hollow: a group with equal rewards, centred ranks as advantages).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).parent / "results"
COLORS = {"stock": "tab:gray", "full": "tab:blue", "response_only": "tab:red"}


def main():
    modes = json.loads((RESULTS / "real_modes_smollm2_cpu.json").read_text())
    cosines = [json.loads(f.read_text()) for f in sorted(RESULTS.glob("real_cosine_smollm2*.json"))]
    fig, (ax_r, ax_t, ax_c) = plt.subplots(1, 3, figsize=(15, 4.2))
    for mode, color in COLORS.items():
        runs = [r for r in modes if r["mode"] == mode]
        if not runs:
            continue
        for r in runs:
            ax_r.plot(range(1, len(r["reward_curve"]) + 1), r["reward_curve"], color=color, alpha=0.3, lw=1)
        n = min(len(r["reward_curve"]) for r in runs)
        mean = [statistics.fmean(r["reward_curve"][i] for r in runs) for i in range(n)]
        ax_r.plot(range(1, n + 1), mean, color=color, lw=2.5, label=f"{mode} ({len(runs)} seeds)")
        times = [t for r in runs for t in r["step_seconds"]]
        ax_t.bar(mode, statistics.median(times), color=color)
    p = modes[0]["prompt_tokens"]
    ax_r.set(xlabel="optimizer step", ylabel="training reward", title=f"locker task, {p}-token prompts")
    ax_r.legend()
    ax_t.set(ylabel="seconds per step (median)", title="time per step, CPU, 1 thread")
    for cosine in cosines:
        rows = cosine["rows"]
        seed = cosine["args"]["seed"]
        ax_c.plot([r["prompt_tokens"] for r in rows], [r["cosine"] for r in rows], "o-", label=f"seed {seed}")
        for r in rows:  # hollow: the group's rewards were all equal, centred ranks stood in for advantages
            if r.get("advantages") != "grpo":
                ax_c.plot(r["prompt_tokens"], r["cosine"], "o", mfc="white", color="k")
    ticks = [512, 1024, 2048, 4096, 8192]
    ax_c.set_xticks(ticks, [f"{t // 1024}K" if t >= 1024 else str(t) for t in ticks])
    ax_c.minorticks_off()
    ax_c.legend()
    ax_c.set(
        xscale="log",
        xlabel="prompt tokens",
        ylabel="cosine(response-only, full)",
        title="gradient cosine, GRPO advantages",
        ylim=(0, 1),
    )
    fig.suptitle("SmolLM2-135M-Instruct, LoRA r=16, fp32 (CPU)")
    fig.tight_layout()
    fig.savefig(RESULTS / "real_modes_smollm2_cpu.png", dpi=110)


if __name__ == "__main__":
    main()
