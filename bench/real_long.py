"""Real weights at real length: Gemma-3-270M on the long-facts task at 16K-32K tokens, on one GPU (``real-long``).

    python bench/real_long.py --prompt 16384 --state-dir /tmp/real_long --budget-s 500       # call again to go on
    python bench/real_long.py --model tiny-gemma3 --device cpu --prompt 300 ...               # the plumbing (tests)

Parts, in order, each resumable (``--parts``; what is finished is kept in ``--state-dir`` and skipped):

- ``check``: our log-probs at the longest length (``--check-length``) against the stock forward's, fp32 and bf16,
  each within the bound the GPU tests use;
- ``train``: per seed, stock TRL ``GRPOTrainer``, ``LongStrawGRPOTrainer(gradient_mode="full")`` and the default
  response-only objective, with the same data (examples/_long_facts.py: documents of ``--prompt`` tokens, training
  documents of seed 1000 + s, held-out documents never trained on), seed, LoRA (rank ``--lora-rank`` on every linear
  layer, alpha 2r, fp32 weights, bf16 autocast on a GPU) and step count; per run the held-out exact accuracy after
  training (before: once, the pretrained model), the training reward of every step, seconds per step by phase and the
  peak memory. A run stops cleanly before ``--budget-s`` (a checkpoint in ``<state>/runs/<arm>_seed<s>/``) and the
  next call resumes it;
- ``cosine``: response-only vs full vs stock gradients of one GRPO group, ``--cosine-groups`` groups at each of
  ``--cosine-lengths`` (bench/real_long_cosine.py).

Every call writes what is finished so far to ``real_long_<model>_<gpu>_P<prompt>.json`` and (when the cosine part
has rows) ``real_cosine_<model>_<gpu>_P<lengths>.json`` in ``$OUT`` (default bench/results/), then prints a table.
``--cache-dir`` sets ``LONGSTRAW_CACHE`` (the dequantised checkpoint is made once and reused by later calls).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

PARTS = ("check", "train", "cosine")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="gemma3-270m", help="a longstraw_trl.pretrained model, or tiny-gemma3")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument(
        "--prompt", type=int, default=16384, help="document tokens of the training and held-out prompts"
    )
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    ap.add_argument("--arms", nargs="+", default=["stock", "full", "response_only"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    ap.add_argument("--num-generations", type=int, default=8, help="G")
    ap.add_argument("--questions-per-step", type=int, default=2, help="groups per optimizer step")
    ap.add_argument("--questions-per-doc", type=int, default=8, help="training questions per document")
    ap.add_argument("--completion-tokens", type=int, default=16, help="R, max_completion_length")
    ap.add_argument("--learning-rate", type=float, default=5e-4, help="AdamW (LoRA), the demo's")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument(
        "--stock-rows-per-forward",
        type=int,
        default=2,
        help="stock GRPOTrainer's per_device_train_batch_size (gradient accumulation makes up the step's rows): at "
        "16K tokens its SDPA over 16 rows asks for 64 GiB",
    )
    ap.add_argument(
        "--stock-prefill-chunk",
        type=int,
        default=2048,
        help="stock GRPOTrainer's generation prefill chunk (transformers' prefill_chunk_size; 0: the whole prompt)",
    )
    ap.add_argument("--temperature", type=float, default=0.5, help="sampling (see examples/_long_facts.py)")
    ap.add_argument(
        "--save-steps", type=int, default=5, help="a checkpoint every N steps (and at a budget stop)"
    )
    ap.add_argument("--eval-docs", type=int, default=8, help="held-out documents")
    ap.add_argument("--eval-questions", type=int, default=16, help="held-out questions per document")
    ap.add_argument("--eval-tokens", type=int, default=6, help="greedy tokens of a held-out answer")
    ap.add_argument(
        "--check-length", type=int, default=0, help="tokens of the log-prob check (0: the longest)"
    )
    ap.add_argument("--cosine-lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32000])
    ap.add_argument("--cosine-groups", type=int, default=4)
    ap.add_argument(
        "--cosine-tries", type=int, default=4, help="questions tried for a group with varied rewards"
    )
    ap.add_argument("--state-dir", default="/tmp/longstraw_real_long")
    ap.add_argument(
        "--resume-from",
        default="",
        metavar="FILE",
        help="a result file of these settings (e.g. bench/results/real_long_gemma3-270m_h100_P16384.json): its "
        "finished runs, check and held-out evaluation are kept and not run again (another machine's state)",
    )
    ap.add_argument(
        "--cache-dir", default="", help="LONGSTRAW_CACHE: where the dequantised checkpoint is kept"
    )
    ap.add_argument(
        "--budget-s", type=float, default=500, help="stop cleanly (checkpoint, results) after this"
    )
    ap.add_argument("--max-steps-per-call", type=int, default=0, help="stop a run after N steps in one call")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    args = ap.parse_args(argv)
    args.doc_tokens = args.prompt
    args.check_length = args.check_length or max([args.prompt, *args.cosine_lengths])
    return args


def settings_of(args) -> dict:
    """What makes two runs of an arm and seed the same run."""
    keys = ("model", "prompt", "steps", "num_generations", "questions_per_step", "questions_per_doc",
            "completion_tokens", "learning_rate", "lora_rank", "temperature", "eval_docs", "eval_questions",
            "eval_tokens")  # fmt: skip
    return {k: getattr(args, k) for k in keys}


class State:
    """The finished parts of the suite in ``--state-dir``: JSON files read and written whole."""

    def __init__(self, root: Path, settings: dict):
        self.root, self.settings = root, settings
        (root / "runs").mkdir(parents=True, exist_ok=True)
        stamp = root / "settings.json"
        if stamp.is_file() and json.loads(stamp.read_text()) != settings:
            raise SystemExit(f"{root} holds runs of other settings: use another --state-dir or remove it")
        stamp.write_text(json.dumps(settings, indent=1))

    def get(self, name: str):
        path = self.root / f"{name}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def finished_runs(self) -> list[dict]:
        """Every finished run's record in the state, by seed and then arm (this call's or an earlier one's)."""
        records = [json.loads(p.read_text()) for p in sorted((self.root / "runs").glob("*_seed*.json"))]
        order = {"stock": 0, "full": 1, "response_only": 2}
        return sorted(records, key=lambda r: (r["seed"], order.get(r["arm"], 3), r["arm"]))

    def resume_from(self, path: Path) -> int:
        """Take the finished runs, the check and the held-out evaluation before training of a result file of the same
        settings (an earlier machine's), where this state lacks them; returns the runs taken."""
        payload = json.loads(path.read_text())
        if payload.get("settings") != self.settings:
            raise SystemExit(
                f"{path} holds runs of other settings than this call's: {payload.get('settings')}"
            )
        for name, value in (("check", payload.get("check")), ("before", payload.get("heldout_before"))):
            if value is not None and self.get(name) is None:
                self.put(name, value)
        taken = [r for r in payload.get("runs", []) if self.get(f"runs/{r['arm']}_seed{r['seed']}") is None]
        for record in taken:
            self.put(f"runs/{record['arm']}_seed{record['seed']}", record)
        return len(taken)

    def put(self, name: str, value) -> None:
        path = self.root / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value, indent=1))


def held_out_rows(tokenizer, args) -> list[dict]:
    from real_long_model import task

    spec = task.TaskSpec(doc_tokens=args.prompt, questions_per_doc=args.eval_questions)
    rows = task.make_split(tokenizer, args.eval_docs, spec, seed=task.HELD_OUT_SEED)
    task.check_prefix(tokenizer, rows[0])
    return rows


def run_check(state: State, model, tokenizer, args) -> None:
    from real_long_model import logprob_check

    if state.get("check") is not None:
        return
    dtypes = ("fp32", "bf16") if args.device == "cuda" else ("fp32",)
    rows = [logprob_check(model, tokenizer, args.check_length, d) for d in dtypes]
    for r in rows:
        against = (f"; to fp32: ours {r['ours_vs_fp32']:.2e}, stock bf16 {r['stock_bf16_vs_fp32']:.2e}"
                   if "ours_vs_fp32" in r else "")  # fmt: skip
        print(f"check P={r['prompt_tokens']} {r['dtype']}: max |dlogp| to stock {r['max_abs_logprob_diff']:.2e}"
              f"{against} (bound {r['bound']:g}: {'ok' if r['within_bound'] else 'OVER'})", flush=True)  # fmt: skip
    state.put("check", rows)


def evaluate_before(state: State, model, tokenizer, rows, args) -> dict:
    from real_long_model import greedy_eval

    before = state.get("before")
    if before is None:
        t0 = time.perf_counter()
        before = greedy_eval(model, tokenizer, rows, args.eval_tokens)
        before["seconds"] = time.perf_counter() - t0
        state.put("before", before)
    print(f"held-out before training: exact {before['accuracy']:.1%} ± {before['accuracy_stderr']:.1%} "
          f"({before['questions']} questions)", flush=True)  # fmt: skip
    return before


def paired_gain(after: list[float], before: list[float]) -> tuple[float, float]:
    diffs = [a - b for a, b in zip(after, before, strict=True)]
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
    return statistics.fmean(diffs), se


def finish_run(
    state: State, name: str, arm: str, seed: int, model, tokenizer, rows, before, extra: dict, args
):
    """Evaluate a trained run, write its record and drop its checkpoints."""
    import real_long_train as rt
    from real_long_model import greedy_eval

    after = greedy_eval(model, tokenizer, rows, args.eval_tokens)
    gain, gain_se = paired_gain(after["per_question"], before["per_question"])
    record = {"arm": arm, "seed": seed, "lora": f"r={args.lora_rank}, alpha={2 * args.lora_rank}, q/k/v/o/gate/up/down",
              "heldout_after": after, "heldout_gain": gain, "heldout_gain_stderr": gain_se, **extra}  # fmt: skip
    state.put(f"runs/{name}", record)
    rt.remove_checkpoints(state.root / "runs" / name)
    print(f"{name}: held-out {before['accuracy']:.1%} -> {after['accuracy']:.1%} ± {after['accuracy_stderr']:.1%}, "
          f"reward {extra.get('reward_first', float('nan')):.2f} -> {extra.get('reward_last', float('nan')):.2f}, "
          f"{extra['seconds_per_step']['mean_after_first'].get('step', float('nan')):.2f} s/step", flush=True)  # fmt: skip


def run_training(state: State, base, tokenizer, args, deadline: float) -> bool:
    """Every (seed, arm) not finished, in order, until the deadline; whether all are finished."""
    rows = held_out_rows(tokenizer, args)
    before = evaluate_before(state, base, tokenizer, rows, args)
    reserve = 1.5 * before["seconds"] + 15  # an evaluation after training, and the checkpoint
    for seed in args.seeds:
        for arm in args.arms:
            if state.get(f"runs/{arm}_seed{seed}") is not None:
                continue
            if time.monotonic() + reserve + 30 > deadline:
                print(f"train: stopped before {arm}_seed{seed} (budget)", flush=True)
                return False
            if not one_run(state, arm, seed, base, tokenizer, (rows, before), args, (deadline, reserve)):
                return False
    return True


def one_run(state: State, arm: str, seed: int, base, tokenizer, heldout, args, budget) -> bool:
    """Train (or resume) and evaluate one run; whether it finished within the budget ``(deadline, reserve)``."""
    import real_long_train as rt

    (deadline, reserve), name = budget, f"{arm}_seed{seed}"
    run_dir = state.root / "runs" / name
    if (run_dir / "final").is_dir():  # trained in an earlier call, not yet evaluated
        model, extra = rt.load_final(base, run_dir), state.get(f"runs/{name}.pending")
    else:
        trainer, clock, peak, finished = rt.train(
            arm, seed, args, base, tokenizer, run_dir, deadline - reserve
        )
        model, extra = trainer.model, run_extra(trainer, clock, peak, args)
        if not finished:
            print(f"{name}: stopped at step {extra['steps_done']}/{args.steps} (budget); resumes next call")
            return False
        if time.monotonic() + reserve > deadline:
            rt.save_final(trainer, run_dir)
            state.put(f"runs/{name}.pending", extra)
            return False
    finish_run(state, name, arm, seed, model, tokenizer, *heldout, extra, args)
    return True


def run_extra(trainer, clock, peak: float, args) -> dict:
    import real_long_train as rt

    curves = rt.logged_curves(trainer)
    rewards = curves["reward_curve"]
    window = max(1, min(5, len(rewards) // 4))
    return {**curves, "steps_done": trainer.state.global_step, "seconds_per_step": rt.step_summary(clock.steps),
            "step_phases": clock.steps, "peak_memory_gib": peak,
            "rows_per_forward": trainer.args.per_device_train_batch_size,
            "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
            "generation_kwargs": trainer.args.generation_kwargs,
            "peak_memory_kind": "torch.cuda.max_memory_allocated" if args.device == "cuda" else "process peak RSS",
            "reward_first": statistics.fmean(rewards[:window]) if rewards else float("nan"),
            "reward_last": statistics.fmean(rewards[-window:]) if rewards else float("nan")}  # fmt: skip


def write_results(state: State, args, wall: float) -> list[Path]:
    """The finished parts so far, as result files (bench/README.md's naming)."""
    from common import write_result
    from real_long_cosine import cosine_table
    from run import gpu_token

    gpu = gpu_token() if args.device == "cuda" else "cpu"
    model = args.model
    asked = [state.get(f"runs/{a}_seed{s}") for s in args.seeds for a in args.arms]
    runs = state.finished_runs()  # this call's arms and seeds, and any others the state holds
    seeds = sorted({*args.seeds, *(r["seed"] for r in runs)})
    arms = list(dict.fromkeys([*args.arms, *(r["arm"] for r in runs)]))
    payload = {"settings": state.settings, "seeds": seeds, "arms": arms, "check": state.get("check"),
               "heldout_before": state.get("before"), "runs": runs, "summary": summary_table(runs),
               "call_seconds": wall, "complete": all(asked)}  # fmt: skip
    paths = [write_result(f"real_long_{model}_{gpu}_P{args.prompt}", payload)]
    cos = state.get("cosine")
    if cos:
        lengths = sorted({r["length"] for r in cos})
        name = f"real_cosine_{model}_{gpu}_P{lengths[0]}-{lengths[-1]}"
        paths.append(write_result(name, {"rows": cos, "table": cosine_table(cos), "lora_rank": args.lora_rank,
                                         "num_generations": args.num_generations,
                                         "completion_tokens": args.completion_tokens}))  # fmt: skip
    return paths


def summary_table(runs: list[dict]) -> list[dict]:
    """Per arm: held-out accuracy after (mean and spread over seeds), gain, s/step, peak memory."""
    out = []
    for arm in dict.fromkeys(r["arm"] for r in runs):
        rs = [r for r in runs if r["arm"] == arm]
        acc = [r["heldout_after"]["accuracy"] for r in rs]
        out.append({"arm": arm, "seeds": len(rs), "accuracy_after_mean": statistics.fmean(acc),
                    "accuracy_after_sd": statistics.stdev(acc) if len(acc) > 1 else float("nan"),
                    "gain_mean": statistics.fmean(r["heldout_gain"] for r in rs),
                    "seconds_per_step": statistics.fmean(r["seconds_per_step"]["mean_after_first"]["step"] for r in rs),
                    "peak_memory_gib": max(r["peak_memory_gib"] for r in rs)})  # fmt: skip
    return out


def print_table(state: State, args) -> None:
    from real_long_cosine import cosine_table

    before = state.get("before")
    runs = state.finished_runs()
    print(f"\nP={args.prompt}: held-out before {before['accuracy']:.1%}" if before else f"\nP={args.prompt}")
    print(f"{'arm':>14} {'seeds':>5} {'after':>7} {'sd':>6} {'gain':>7} {'s/step':>7} {'peak GiB':>8}")
    for r in summary_table(runs):
        print(f"{r['arm']:>14} {r['seeds']:>5} {r['accuracy_after_mean']:>7.1%} {r['accuracy_after_sd']:>6.1%} "
              f"{r['gain_mean']:>+7.1%} {r['seconds_per_step']:>7.2f} {r['peak_memory_gib']:>8.2f}")  # fmt: skip
    for c in cosine_table(state.get("cosine") or []):
        ro, st = c["response_only_vs_full"], c["response_only_vs_stock"]
        print(f"cosine P={c['prompt_tokens']:>6} ({c['groups']} groups): ro/full {ro['cosine_mean']:.3f} "
              f"[{ro['cosine_min']:.3f}, {ro['cosine_max']:.3f}] norm ratio {ro['norm_ratio_mean']:.3f}; "
              f"ro/stock {st['cosine_mean']:.3f}; full/stock {c['full_vs_stock']['cosine_mean']:.4f}")  # fmt: skip
    left = [f"{a}_seed{s}" for s in args.seeds for a in args.arms if not state.get(f"runs/{a}_seed{s}")]
    print("remaining runs: " + (", ".join(left) if left else "none"))


def main(argv=None) -> int:
    args = parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    t0 = time.perf_counter()
    if args.cache_dir:
        os.environ["LONGSTRAW_CACHE"] = args.cache_dir
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")
    import torch
    from real_long_model import load

    if args.threads:
        torch.set_num_threads(args.threads)
    state = State(Path(args.state_dir), settings_of(args))
    if args.resume_from:  # relative to here, or to the repository (the runner calls this in bench/)
        path = Path(args.resume_from)
        path = path if path.is_file() else HERE.parent / args.resume_from
        print(f"resumed {state.resume_from(path)} finished run(s) from {path}")
    base, tokenizer = load(args.model, args.device)
    positions = base.config.max_position_embeddings
    if max(args.prompt, args.check_length) + 64 + args.completion_tokens > positions:
        raise SystemExit(
            f"{args.model} takes {positions} positions: a prompt of {args.prompt} tokens, its question "
            f"and {args.completion_tokens} completion tokens do not fit (use --prompt 32000 at most)"
        )
    print(f"model {args.model} loaded on {args.device} in {time.perf_counter() - t0:.0f} s", flush=True)
    if "check" in args.parts:
        run_check(state, base, tokenizer, args)
    trained = "train" not in args.parts or run_training(state, base, tokenizer, args, deadline)
    if "cosine" in args.parts and trained:  # after the training runs: they come first
        from real_long_cosine import run_cosine

        run_cosine(base, tokenizer, args, state.root, deadline)
    for path in write_results(state, args, time.perf_counter() - t0):
        print(f"wrote {path}")
    print_table(state, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
