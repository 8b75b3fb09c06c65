"""Side by side with the stock path: the largest P that fits, and the step time at equal P.

Stock = what TRL's ``GRPOTrainer`` runs for each completion: the HF model's full forward over
``prompt + completion`` with gradient checkpointing on (TRL's default), log-probs of the completion
positions (``logits_to_keep``), a GRPO-style loss and ``backward()``; one sequence per micro-batch (its
smallest footprint), G sequences per group. LongStraw = capture once, generate-free replays of the same G
completions with backward one at a time. Same model, same data, same G and R.

    python bench/compare_stock.py --preset qwen3.6-27b --prompts 32768 131072 524288 1048576 --groups 8
    python bench/compare_stock.py --preset qwen3-8b --prompts 32768 131072 524288 --groups 8

Each P runs both paths (a path that ran out of memory is recorded as OOM and not retried at larger P).
Writes JSON; ``bench/plot.py`` draws the PNG.
"""

from __future__ import annotations

import argparse
import gc

import torch
from common import Timer, peak_gib, print_table, reset_peak, write_result
from engine_slice import slice_config
from transformers import AutoModelForCausalLM

from longstraw_trl import capture_prompt


def stock_step(model, prompt, completions) -> None:
    for c in completions:  # one sequence per micro-batch
        ids = torch.cat([prompt, c])[None]
        logits = model(ids, logits_to_keep=c.numel() + 1).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, c[None, :, None])[..., 0]
        (-logp.mean()).backward()
        del logits, logp


def longstraw_step(model, prompt, completions, chunk: int, page: int) -> dict:
    with Timer() as t_cap:
        state = capture_prompt(model, prompt, chunk_size=chunk, page_size=page, progress=False)
    with Timer() as t_rep:
        for c in completions:
            (-state.logprobs(model, c[None], grad=True).mean()).backward()
    return {"capture_s": t_cap.seconds, "replay_s": t_rep.seconds}


def attempt(fn, *args):
    try:
        reset_peak()
        with Timer() as t:
            extra = fn(*args)
        return {"ok": True, "step_s": t.seconds, "peak_gib": peak_gib(), **(extra or {})}
    except torch.OutOfMemoryError:
        return {"ok": False, "oom": True}
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3.6-27b", choices=["qwen3-8b", "qwen3.6-27b"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--response", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=16384)
    ap.add_argument("--page", type=int, default=16384)
    ap.add_argument("--tiny", action="store_true", help="dry run on CPU with tiny dimensions")
    args = ap.parse_args()
    dev = "cpu" if args.tiny else "cuda"

    torch.manual_seed(0)
    config = slice_config(args.preset, args.layers, max(args.prompts) + args.response + 16, args.tiny)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()

    rows, results, stock_ok, ours_ok = [], [], True, True
    for p in args.prompts:
        g = torch.Generator(device=dev).manual_seed(p)
        prompt = torch.randint(0, config.vocab_size, (p,), device=dev, generator=g)
        comps = torch.randint(0, config.vocab_size, (args.groups, args.response), device=dev, generator=g)
        stock = attempt(stock_step, model, prompt, comps) if stock_ok else {"ok": False, "skipped": True}
        model.zero_grad(set_to_none=True)
        ours = (
            attempt(longstraw_step, model, prompt, comps, args.chunk, args.page)
            if ours_ok
            else {"ok": False, "skipped": True}
        )
        model.zero_grad(set_to_none=True)
        stock_ok, ours_ok = stock.get("ok", False), ours.get("ok", False)
        ratio = stock["step_s"] / ours["step_s"] if stock_ok and ours_ok else None
        results.append({"prompt_tokens": p, "stock": stock, "longstraw": ours, "stock_over_longstraw": ratio})
        rows.append(
            {
                "P": p,
                "stock s": f"{stock['step_s']:.1f}" if stock_ok else "OOM" if stock.get("oom") else "-",
                "stock GiB": f"{stock['peak_gib']:.1f}" if stock_ok else "",
                "longstraw s": f"{ours['step_s']:.1f}" if ours_ok else "OOM" if ours.get("oom") else "-",
                "longstraw GiB": f"{ours['peak_gib']:.1f}" if ours_ok else "",
                "stock/longstraw": f"{ratio:.2f}" if ratio else "",
            }
        )
        write_result(
            f"compare_stock_{args.preset}_{args.layers}L",
            {
                "preset": args.preset,
                "layers": args.layers,
                "generations": args.groups,
                "response_tokens": args.response,
                "stock": "HF full forward+backward per sequence, gradient checkpointing on (TRL's default)",
                "results": results,
            },
        )
    print(f"{args.preset} x{args.layers} layers, G={args.groups}, R={args.response}")
    print_table(rows)


if __name__ == "__main__":
    main()
