"""Learning curves of stock GRPOTrainer, gradient_mode="full" and the response-only default on the demo task (CPU).

    python bench/learning_curves.py --seeds 0 1 2 --steps 12 --facts 20
    python bench/learning_curves.py --collect          # rebuild the JSON and the PNG from the finished runs

Every run is examples/grpo_lockers.py's task and trainer settings (imported, not copied): SmolLM2-135M-Instruct,
LoRA r=16 on every linear layer, fp32, one thread, the same data order, seed and hyper-parameters in every arm; only
the trainer differs (``stock``: TRL's GRPOTrainer; ``full`` / ``response_only``: LongStrawGRPOTrainer's
``gradient_mode``). Activation checkpointing is the same in all three: on by default (TRL's and the demo's default;
without it stock GRPOTrainer's 16 sequences of ~650 tokens took 20 GiB here, SDPA's CPU math path). Each
run records the training reward and the wall time of every optimizer step (generation and the document capture
included) and the held-out exact accuracy after training, measured by the demo's own ``greedy_eval`` for every arm.
The held-out accuracy before training is measured once: LoRA starts with B = 0, so the untrained model is the
pretrained one for every arm and seed.

Resumable: each (arm, seed) writes ``<runs-dir>/<arm>_seed<seed>.json`` when it finishes and is skipped when that
file exists with the same settings; after every run the combined ``--out`` JSON (and the PNG, where matplotlib is
installed) is rebuilt from the run files.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE))

import grpo_lockers as demo  # noqa: E402
from common import git_revision  # noqa: E402
from real_modes import StepTimes, stock_trainer  # noqa: E402

from longstraw_trl.pretrained import load_pretrained  # noqa: E402

ARMS = ("stock", "full", "response_only")
# the settings that make two runs comparable (everything of the demo's but the seed and output dir)
RUN_KEYS = (
    "model",
    "facts",
    "filler",
    "questions_per_doc",
    "eval_docs",
    "eval_questions",
    "steps",
    "num_generations",
    "questions_per_step",
    "completion_tokens",
    "learning_rate",
    "lora_rank",
    "temperature",
    "refresh_interval",
    "no_activation_checkpointing",
    "threads",
)


def settings_of(args) -> dict:
    return {k: getattr(args, k) for k in RUN_KEYS}


def run_one(arm: str, seed: int, args, held_out: list[dict], before: dict) -> dict:
    torch.manual_seed(seed)
    model, tokenizer = load_pretrained(args.model)
    n_docs = math.ceil(args.steps * args.questions_per_step / args.questions_per_doc)
    rows = demo.make_split(
        n_docs, args.questions_per_doc, args, seed=1000 + seed
    )  # the demo's data, per seed
    timer = StepTimes()  # placed first: a step's time includes the demo's document capture at step begin
    t0 = time.perf_counter()
    if arm == "stock":
        trainer = stock_trainer(args, model, tokenizer, rows)
    else:
        args.gradient_mode = arm
        trainer = demo.build_trainer(args, model, tokenizer, rows)
    trainer.callback_handler.callbacks.insert(0, timer)
    trainer.train()
    train_seconds = time.perf_counter() - t0
    after = demo.greedy_eval(
        trainer.model, tokenizer, held_out, args.completion_tokens, f"{arm} s{seed} after"
    )
    logs = [h for h in trainer.state.log_history if "reward" in h]
    diffs = [a - b for a, b in zip(after["per_question"], before["per_question"], strict=True)]
    window = max(1, args.steps // 4)
    curve = [h["reward"] for h in logs]
    return {
        "arm": arm,
        "seed": seed,
        "settings": settings_of(args),
        "document_tokens": demo.token_ids(tokenizer, rows[0]["doc"]).numel(),
        "prompt_tokens": demo.token_ids(tokenizer, rows[0]["doc"] + rows[0]["question"]).numel(),
        "reward_curve": curve,
        "reward_std_curve": [h.get("reward_std") for h in logs],
        "step_seconds": timer.times,
        "median_step_seconds": statistics.median(timer.times),
        "train_seconds": train_seconds,
        "reward_window": window,
        "train_reward_first_steps": statistics.fmean(curve[:window]),
        "train_reward_last_steps": statistics.fmean(curve[-window:]),
        "heldout_after": after,
        "heldout_gain": statistics.fmean(diffs),
        "heldout_gain_stderr": statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None,
        "load_average_at_end": os.getloadavg(),
        "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_revision": git_revision(),
    }


def spread(values: list[float]) -> dict:
    return {
        "mean": statistics.fmean(values),
        "sd": statistics.stdev(values) if len(values) > 1 else None,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def collect(runs_dir: Path, out: Path, command: str, before: dict | None) -> dict:
    runs = [json.loads(p.read_text()) for p in sorted(runs_dir.glob("*_seed*.json"))]
    if before is None and (runs_dir / "heldout_before.json").exists():
        before = json.loads((runs_dir / "heldout_before.json").read_text())
    summary = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        if not mine:
            continue
        summary[arm] = {
            "seeds": [r["seed"] for r in mine],
            "heldout_after_accuracy": spread([r["heldout_after"]["accuracy"] for r in mine]),
            "heldout_gain": spread([r["heldout_gain"] for r in mine]),
            "train_reward_last_steps": spread([r["train_reward_last_steps"] for r in mine]),
            "median_step_seconds": spread([r["median_step_seconds"] for r in mine]),
        }
    payload = {
        "benchmark": "learning_curves_smollm2",
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_revision": git_revision(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "heldout_before": before and {k: v for k, v in before.items() if k != "per_question"},
        "summary": summary,
        "runs": [
            {**r, "heldout_after": {k: v for k, v in r["heldout_after"].items() if k != "per_question"}}
            for r in runs
        ],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.stem}.{os.getpid()}.tmp")  # two processes (arms) may finish at once
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    tmp.replace(out)
    try:
        tmp = out.with_name(f"{out.stem}.{os.getpid()}.png")
        plot(payload, tmp)
        tmp.replace(out.with_suffix(".png"))
    except ImportError:
        print("matplotlib not installed: no PNG")
    return payload


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"stock": "tab:gray", "full": "tab:blue", "response_only": "tab:red"}
    labels = {
        "stock": "stock GRPOTrainer",
        "full": 'gradient_mode="full"',
        "response_only": "response-only (default)",
    }
    runs = payload["runs"]
    fig, (ax_r, ax_h, ax_t) = plt.subplots(1, 3, figsize=(16, 4.4))
    for i, arm in enumerate(ARMS):
        mine = [r for r in runs if r["arm"] == arm]
        if not mine:
            continue
        n = min(len(r["reward_curve"]) for r in mine)
        steps = range(1, n + 1)
        mean = [statistics.fmean(r["reward_curve"][s] for r in mine) for s in range(n)]
        lo = [min(r["reward_curve"][s] for r in mine) for s in range(n)]
        hi = [max(r["reward_curve"][s] for r in mine) for s in range(n)]
        ax_r.plot(steps, mean, color=colors[arm], lw=2.2, label=f"{labels[arm]} ({len(mine)} seeds)")
        ax_r.fill_between(steps, lo, hi, color=colors[arm], alpha=0.15)
        after = [r["heldout_after"]["accuracy"] for r in mine]
        ax_h.bar(i, statistics.fmean(after), color=colors[arm], alpha=0.6)
        ax_h.plot([i] * len(after), after, "o", color="k", ms=4)
        times = [r["median_step_seconds"] for r in mine]
        ax_t.bar(i, statistics.fmean(times), color=colors[arm], alpha=0.8)
        ax_t.plot([i] * len(times), times, "o", color="k", ms=4)
    before = payload.get("heldout_before")
    if before:
        ax_h.axhline(before["accuracy"], color="k", ls="--", lw=1, label=f"before: {before['accuracy']:.0%}")
        ax_h.legend(loc="lower right")
    for ax in (ax_h, ax_t):
        ax.set_xticks(range(len(ARMS)), ["stock", "full", "response-only"])
    p = runs[0]["prompt_tokens"] if runs else "?"
    ax_r.set(
        xlabel="optimizer step",
        ylabel="training reward (mean; band: min-max over seeds)",
        title=f"locker task, ~{p}-token prompts",
        ylim=(0, 1.02),
    )
    ax_r.legend(loc="lower right")
    ax_h.set(ylabel="held-out exact accuracy after training", title="held-out (dots: seeds)", ylim=(0, 1.02))
    ax_t.set(ylabel="seconds per step (median of a run)", title="time per step, CPU, 1 thread (dots: seeds)")
    fig.suptitle("SmolLM2-135M-Instruct, LoRA r=16, fp32, same data, seeds and budget per arm")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", default=str(HERE / "results" / "learning_curves_smollm2_cpu.json"))
    ap.add_argument("--runs-dir", default=None, help="default: <out without .json>_runs/")
    ap.add_argument("--collect", action="store_true", help="only rebuild the JSON and PNG from finished runs")
    ap.add_argument("--dry-run", action="store_true", help="a tiny task, 1 step per arm, out to $OUT or /tmp")
    ap.add_argument(
        "--activation-checkpointing",
        choices=["on", "off"],
        default="on",
        help="the same in every arm; on: TRL's and the demo's default (stock without it runs out of memory here)",
    )
    own, rest = ap.parse_known_args(argv)
    if own.dry_run:
        out_dir = Path(os.environ.get("OUT") or "/tmp/longstraw_learning_curves_dry")
        own.out = str(out_dir / "learning_curves_dry.json")
        rest = ["--facts", "3", "--steps", "1", "--num-generations", "2", "--questions-per-step", "1",
                "--questions-per-doc", "1", "--eval-docs", "1", "--eval-questions", "2",
                "--completion-tokens", "3", *rest]  # fmt: skip
    out = Path(own.out)
    runs_dir = Path(own.runs_dir) if own.runs_dir else out.with_name(out.stem + "_runs")
    runs_dir.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python", "bench/learning_curves.py", *(argv if argv is not None else sys.argv[1:])])
    if own.collect:
        collect(runs_dir, out, command, None)
        return
    if own.activation_checkpointing == "off":
        rest = [*rest, "--no-activation-checkpointing"]
    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = demo.parse_args([*rest, "--output-dir", "/tmp/longstraw_learning_curves"])
    torch.set_num_threads(args.threads)
    held_out = demo.make_split(
        args.eval_docs, args.eval_questions, args, seed=10**6
    )  # the demo's held-out set

    before_path = runs_dir / "heldout_before.json"
    before = json.loads(before_path.read_text()) if before_path.exists() else None
    if before is None or before.get("settings") != settings_of(args):
        model, tokenizer = load_pretrained(args.model)
        before = demo.greedy_eval(model, tokenizer, held_out, args.completion_tokens, "held-out before")
        before["settings"] = settings_of(args)
        before_path.write_text(json.dumps(before, indent=1) + "\n")
        del model
    print(f"held-out before: {before['accuracy']:.1%} ± {before['accuracy_stderr']:.1%}", flush=True)

    for seed in own.seeds:
        for arm in own.arms:
            path = runs_dir / f"{arm}_seed{seed}.json"
            if path.exists() and json.loads(path.read_text())["settings"] == settings_of(args):
                print(f"{arm} seed {seed}: done already ({path})", flush=True)
                continue
            result = run_one(arm, seed, _with_seed(args, seed), held_out, before)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(result, indent=1) + "\n")
            tmp.replace(path)
            print(
                f"{arm} seed {seed}: held-out {before['accuracy']:.1%} -> {result['heldout_after']['accuracy']:.1%}, "
                f"reward {result['train_reward_first_steps']:.2f} -> {result['train_reward_last_steps']:.2f}, "
                f"median {result['median_step_seconds']:.1f} s/step, {result['train_seconds']:.0f} s",
                flush=True,
            )
            collect(runs_dir, out, command, before)
    collect(runs_dir, out, command, before)


def _with_seed(args, seed: int) -> argparse.Namespace:
    copy = argparse.Namespace(**vars(args))
    copy.seed = seed
    return copy


if __name__ == "__main__":
    main()
