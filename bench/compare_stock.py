"""Side by side with stock TRL: the largest prompt that fits, and the step time at equal P.

Both sides run their trainer's own loss code on the same model, the same prompt, the same G completions
and advantages (generation is left out of both: stock TRL would sample through ``model.generate``;
``engine_slice.py`` times LongStraw's generation):

- stock: TRL's ``GRPOTrainer`` with its defaults (activation checkpointing on, ``dapo``, ``beta=0``), one
  completion per micro-batch (``per_device_train_batch_size=1``: its smallest footprint; TRL's default of 8
  would hold eight ``P + R`` sequences at once) and ``gradient_accumulation_steps=G``: for each completion
  ``compute_loss`` (the HF model's forward over ``prompt + completion``) and ``backward``.
- LongStraw: ``LongStrawGRPOTrainer``'s loss path on one micro-batch of the G completions: capture the
  prompt once, then replay each completion with autograd, its loss term and ``backward``.

Gradients are allocated (zero) before each measured step, as every micro-step but the first sees them.
Both paths are warmed up first at a small P. A path that ran out of memory is recorded as OOM (with
``peak_gib_at_oom``) and not tried at larger P; LongStraw runs first at each P. Under ``--budget-s`` a path
whose G sequences would not fit in the remaining time runs fewer and records ``sequences_run`` with a
per-sequence time (``step_s`` is then absent, ``step_s_projected`` = per-sequence x G).

    python bench/compare_stock.py --preset qwen3-8b --prompts 32768 131072 524288 1048576
    python bench/compare_stock.py --preset qwen3.6-27b --prompts 32768 131072 262144

Writes JSON after every P; ``bench/plot.py`` draws the PNG.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
import warnings

import torch
from common import Timer, peak_gib, preallocate_gradients, print_table, reset_peak, write_result
from datasets import Dataset
from engine_slice import slice_config
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from longstraw_trl import LongStrawGRPOConfig, LongStrawGRPOTrainer
from longstraw_trl.state_cache import prompt_key as _prompt_key
from longstraw_trl.toy_tokenizer import build_toy_tokenizer


def _zero_reward(completions, **kwargs):
    return [0.0 for _ in completions]


def build_trainers(model, args, dev: str) -> tuple[GRPOTrainer, LongStrawGRPOTrainer]:
    """A stock `GRPOTrainer` and a `LongStrawGRPOTrainer` on the same model, TRL's defaults otherwise."""
    common = dict(
        output_dir=tempfile.mkdtemp(prefix="longstraw_bench_"),
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        num_generations=args.groups,
        max_completion_length=args.response,
        use_cpu=dev == "cpu",
        bf16=dev == "cuda",
    )
    tokenizer = build_toy_tokenizer(model.config.vocab_size)
    dataset = Dataset.from_dict({"prompt": ["a"] * args.groups})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stock_args = GRPOConfig(
            per_device_train_batch_size=1, gradient_accumulation_steps=args.groups, **common
        )
        ours_args = LongStrawGRPOConfig(
            per_device_train_batch_size=args.groups,
            gradient_accumulation_steps=1,
            capture_chunk_size=args.chunk,
            page_size=args.page,
            **common,
        )
        stock, ours = (
            cls(
                model=model,
                reward_funcs=_zero_reward,
                args=a,
                train_dataset=dataset,
                processing_class=tokenizer,
            )
            for cls, a in ((GRPOTrainer, stock_args), (LongStrawGRPOTrainer, ours_args))
        )
    for trainer in (stock, ours):  # normally set by the training loop
        trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    # what `Trainer.train()` does first (both configs keep TRL's default: activation checkpointing on)
    assert stock_args.activation_checkpointing and ours_args.activation_checkpointing
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs=stock_args.activation_checkpointing_kwargs or None
    )
    model.train()
    return stock, ours


def stock_step(trainer: GRPOTrainer, prompt, comps, advantages, deadline: float, limit: int | None) -> dict:
    g, r = comps.shape
    seconds = []
    for j in range(min(g, limit or g)):
        if seconds and time.perf_counter() + seconds[-1] > deadline:
            break
        inputs = {
            "prompt_ids": prompt[None],
            "prompt_mask": torch.ones_like(prompt)[None],
            "completion_ids": comps[j : j + 1],
            "completion_mask": torch.ones_like(comps[j : j + 1]),
            "advantages": advantages[j : j + 1],
            "num_items_in_batch": torch.tensor(g * r, device=prompt.device),
        }
        with Timer() as t:
            with trainer.compute_loss_context_manager():
                loss = trainer.compute_loss(trainer.model, inputs)
            trainer.accelerator.backward(loss)
            del loss
        seconds.append(t.seconds)
    return _timing(seconds, g)


def longstraw_step(trainer: LongStrawGRPOTrainer, prompt, comps, advantages) -> dict:
    g, r = comps.shape
    metrics = trainer._metrics["train"]
    metrics.clear()
    inputs = {
        "completion_ids": comps,
        "completion_mask": torch.ones_like(comps),
        "advantages": advantages,
        "num_items_in_batch": torch.tensor(g * r, device=prompt.device),
        "longstraw_prompts": [(_prompt_key(prompt), prompt.cpu())],
    }
    with Timer() as t:
        with trainer.compute_loss_context_manager():
            trainer.micro_batch_loss(trainer.model, inputs, backward=True)
    trainer.free_prompt_states()
    capture_s = metrics["longstraw/capture_seconds"][-1]
    replay_s = metrics["longstraw/replay_seconds"][-1]
    return {
        "step_s": t.seconds,
        "sequences_run": g,
        "capture_s": capture_s,
        "replay_s_per_response": replay_s / g,
        "state_bytes": sum(v[-1] for k, v in metrics.items() if k.startswith("longstraw/state_bytes/")),
    }


def _timing(seconds: list[float], g: int) -> dict:
    if len(seconds) == g:
        return {"step_s": sum(seconds), "sequences_run": g}
    per = sum(seconds) / len(seconds)
    return {"sequences_run": len(seconds), "per_sequence_s": per, "step_s_projected": per * g}


def attempt(step, trainer, *args) -> dict:
    oom = False
    try:
        preallocate_gradients(trainer.model)
        reset_peak()
        result = {"ok": True, **step(trainer, *args), "peak_gib": peak_gib()}
    except torch.OutOfMemoryError:
        oom = True  # leave the except block first: its traceback holds the failed step's tensors
    if oom:
        result = {"ok": False, "oom": True, "peak_gib_at_oom": peak_gib()}
    trainer.model.zero_grad(set_to_none=True)
    if isinstance(trainer, LongStrawGRPOTrainer):
        trainer.free_prompt_states()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def _cell(r: dict, key: str = "step_s") -> str:
    if r.get("oom"):
        return "OOM"
    if not r.get("ok"):
        return "-"
    if key in r:
        return f"{r[key]:.1f}"
    return f"{r['step_s_projected']:.1f}*"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3.6-27b", choices=["qwen3-8b", "qwen3.6-27b"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--response", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=16384)
    ap.add_argument("--page", type=int, default=16384)
    ap.add_argument(
        "--budget-s", type=float, default=540.0, help="stop starting work after this many seconds"
    )
    ap.add_argument(
        "--stock-sequences",
        type=int,
        default=None,
        help="at most this many stock sequences per P (default: G)",
    )
    ap.add_argument("--tag", default="", help="suffix of the JSON name (keeps earlier runs' files)")
    ap.add_argument("--tiny", action="store_true", help="dry run on CPU with tiny dimensions")
    args = ap.parse_args()
    if args.stock_sequences is not None and args.stock_sequences < 1:
        ap.error("--stock-sequences must be >= 1")
    start = time.perf_counter()
    deadline = start + args.budget_s
    dev = "cpu" if args.tiny else "cuda"

    torch.manual_seed(0)
    config = slice_config(args.preset, args.layers, max(args.prompts) + args.response + 16, args.tiny)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    stock, ours = build_trainers(model, args, dev)

    rows, results, stock_ok, ours_ok = [], [], True, True
    payload = {
        "preset": args.preset,
        "layers": args.layers,
        "model": f"{args.preset} layer dimensions, {args.layers} layers, random init, bf16, full fine-tuning",
        "generations": args.groups,
        "response_tokens": args.response,
        "stock": "trl.GRPOTrainer defaults (activation checkpointing on, dapo, beta=0), one completion per "
        "micro-batch, compute_loss + backward per completion; generation not included",
        "longstraw": "LongStrawGRPOTrainer loss path: capture once, replay + loss + backward per completion; "
        "generation not included",
        "activation_checkpointing": model.is_activation_checkpointing,
        "results": results,
    }
    # warm-up (kernel compilation, allocator growth) on both paths, so the first P measures steady state
    g = torch.Generator(device=dev).manual_seed(1)
    warm_p = min(min(args.prompts), 2 * args.chunk)
    warm = torch.randint(0, config.vocab_size, (warm_p,), device=dev, generator=g)
    warm_comps = torch.randint(0, config.vocab_size, (2, args.response), device=dev, generator=g)
    warm_adv = torch.tensor([1.0, -1.0], device=dev)
    attempt(longstraw_step, ours, warm, warm_comps, warm_adv)
    attempt(stock_step, stock, warm, warm_comps, warm_adv, float("inf"), None)

    for p in args.prompts:
        g = torch.Generator(device=dev).manual_seed(p)
        prompt = torch.randint(0, config.vocab_size, (p,), device=dev, generator=g)
        comps = torch.randint(0, config.vocab_size, (args.groups, args.response), device=dev, generator=g)
        advantages = torch.randn(args.groups, device=dev, generator=g)
        left = lambda: deadline - time.perf_counter() > 0  # noqa: E731
        skipped = {"ok": False, "skipped": True}
        # LongStraw first: it is the short one, so a stock run that uses up the budget cannot skip it
        o = attempt(longstraw_step, ours, prompt, comps, advantages) if ours_ok and left() else skipped
        s = (
            attempt(stock_step, stock, prompt, comps, advantages, deadline, args.stock_sequences)
            if stock_ok and left()
            else skipped
        )
        stock_ok, ours_ok = not s.get("oom") and stock_ok, not o.get("oom") and ours_ok
        ratio = s["step_s"] / o["step_s"] if "step_s" in s and "step_s" in o else None
        entry = {"prompt_tokens": p, "stock": s, "longstraw": o, "stock_over_longstraw": ratio}
        if "step_s_projected" in s and "step_s" in o:
            entry["stock_projected_over_longstraw"] = s["step_s_projected"] / o["step_s"]
        results.append(entry)
        rows.append(
            {
                "P": p,
                "stock s": _cell(s),
                "stock GiB": f"{s['peak_gib']:.1f}" if s.get("ok") else "",
                "longstraw s": _cell(o),
                "longstraw GiB": f"{o['peak_gib']:.1f}" if o.get("ok") else "",
                "stock/longstraw": f"{ratio:.2f}"
                if ratio
                else f"{entry['stock_projected_over_longstraw']:.2f}*"
                if "stock_projected_over_longstraw" in entry
                else "",
            }
        )
        path = write_result(f"compare_stock_{args.preset}_{args.layers}L{args.tag}", payload)
    print(
        f"{args.preset} x{args.layers} layers, G={args.groups}, R={args.response} (* = projected from fewer sequences)"
    )
    print_table(rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
