"""The full-sequence gradient and reverse block replay on a real-dimension slice.

A ``qwen3.6-27b`` slice (``--layers 4``: 3 GDN + 1 gated full attention; random bf16 weights, full fine-tuning):

- ``--prompt P ...``: one training step on a prompt of P tokens and G random completions of R tokens (generation is
  skipped), in both gradient modes: ``response_only`` (capture, G replays + backward) and ``full`` (capture keeping
  the GDN boundary states, G replays + backward accumulating the prompt state's gradient, then the prompt backward:
  the capture chunks recomputed under autograd in reverse). Seconds and peak memory of each phase, the gradient
  buffers' bytes and the kept GDN boundary states' bytes.
- ``--long-response R``: one response of R tokens after a short prompt, replayed whole with backward (its OOM is
  caught and reported) and by reverse block replay (``--block``): peak memory and seconds of each.
- A small bf16 check first: the full-mode gradient against the stock model's full forward + backward (relative L2
  of all parameters), and the response-only gradient's distance to it (how much the prompt path weighs here).

Results go to ``full_gradient_<preset>_<L>L<tag>.json`` after each measurement (a run cut short keeps them).

    python bench/full_gradient.py --prompt 524288 1048576 --groups 8 --response 2048
    python bench/full_gradient.py --prompt --long-response 65536 --block 4096
    python bench/full_gradient.py --smoke     # CPU, tiny dimensions (tests/test_bench_scripts.py)
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from common import (
    GiB,
    Timer,
    kernel_profiler,
    peak_gib,
    preallocate_gradients,
    print_table,
    reset_peak,
    top_kernels,
    write_result,
)
from engine_slice import slice_config
from transformers import AutoModelForCausalLM

from longstraw_trl import capture_prompt, replay_logprobs
from longstraw_trl.engine import StateGrads, prompt_backward, replay_blocks_backward


def _flat_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])


def check_full_gradient(model, vocab: int, dev: str, prompt_len: int, r: int, chunk: int) -> dict:
    """bf16: the engine's full gradient (2 responses) against the stock model's full forward and backward."""
    g = torch.Generator(device=dev).manual_seed(0)
    prompt = torch.randint(0, vocab, (prompt_len,), device=dev, generator=g)
    comps = torch.randint(0, vocab, (2, r), device=dev, generator=g)
    model.zero_grad(set_to_none=True)
    for i in range(2):
        logits = model(torch.cat([prompt, comps[i]])[None]).logits[0, prompt_len - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, comps[i][:, None])[:, 0]
        (-logp.mean()).backward()
    ref = _flat_grads(model)
    out = {}
    for mode in ("full", "response_only"):
        model.zero_grad(set_to_none=True)
        state = capture_prompt(model, prompt, chunk_size=chunk, page_size=chunk, keep_boundaries=True)
        grads = StateGrads(state) if mode == "full" else None
        for i in range(2):
            (-replay_logprobs(state, model, comps[i][None], grad=True, grads=grads).mean()).backward()
        if grads is not None:
            prompt_backward(state, model, grads)
        got = _flat_grads(model)
        out[f"{mode}_rel_l2_vs_stock_full"] = float((got - ref).norm() / ref.norm())
        del state, grads
    model.zero_grad(set_to_none=True)
    return out


def step(model, config, args, prompt_len: int, dev: str, mode: str) -> dict:
    """One step (capture, G replays with backward, and for ``full`` the prompt backward): seconds and peaks."""
    model.zero_grad(set_to_none=True)
    preallocate_gradients(model)
    gen = torch.Generator(device=dev).manual_seed(prompt_len)
    prompt = torch.randint(0, config.vocab_size, (prompt_len,), device=dev, generator=gen)
    comps = torch.randint(0, config.vocab_size, (args.groups, args.response), device=dev, generator=gen)
    full = mode == "full"
    reset_peak()
    with Timer() as t_cap:
        state = capture_prompt(
            model, prompt, chunk_size=args.chunk, page_size=args.page, progress=False, keep_boundaries=full
        )
    out = {
        "mode": mode,
        "prompt_tokens": prompt_len,
        "capture_s": t_cap.seconds,
        "capture_peak_gib": peak_gib(),
    }
    out["state_bytes_by_kind"] = state.nbytes_by_kind()
    if full:
        kept = {id(t): t for b in state.boundaries.values() for layer in b.values() for t in layer.tensors()}
        out["kept_boundaries"] = len(state.boundaries)
        out["kept_boundary_bytes"] = sum(t.numel() * t.element_size() for t in kept.values())
    grads = StateGrads(state) if full else None
    reset_peak()
    times = []
    for i in range(args.groups):
        with Timer() as t:
            logp = replay_logprobs(state, model, comps[i][None], grad=True, grads=grads)
            (-logp.mean()).backward()
        times.append(t.seconds)
        del logp
    out["replay_s_total"] = sum(times)
    out["replay_s_per_response"] = sum(times[1:]) / max(len(times) - 1, 1)
    out["replay_peak_gib"] = peak_gib()
    out["prompt_backward_s"] = 0.0
    if full:
        out["gradient_buffer_bytes"] = grads.nbytes()
        reset_peak()
        profiler = kernel_profiler() if args.profile else contextlib.nullcontext()
        with profiler as prof, Timer() as t_back:
            prompt_backward(state, model, grads, progress=False)
        out["prompt_backward_s"] = t_back.seconds
        if args.profile:
            out["prompt_backward_profile"] = top_kernels(prof, args.profile)
            args.profile = 0  # the first full step only: the profiler slows what it watches
        out["prompt_backward_peak_gib"] = peak_gib()
    out["step_s"] = out["capture_s"] + out["replay_s_total"] + out["prompt_backward_s"]
    del state, grads
    return out


def long_response(model, config, args, dev: str) -> list[dict]:
    """One response of ``--long-response`` tokens: whole replay (OOM caught) against reverse block replay."""
    gen = torch.Generator(device=dev).manual_seed(1)
    prompt = torch.randint(0, config.vocab_size, (args.long_prompt,), device=dev, generator=gen)
    comp = torch.randint(0, config.vocab_size, (args.long_response,), device=dev, generator=gen)
    state = capture_prompt(model, prompt, chunk_size=args.chunk, page_size=args.page, progress=False)
    rows = []
    for how in ("blocks", "whole"):  # blocks first: the whole replay may run out of memory
        model.zero_grad(set_to_none=True)
        preallocate_gradients(model)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        reset_peak()
        row = {"replay": how, "response_tokens": args.long_response, "prompt_tokens": args.long_prompt}
        try:
            with Timer() as t:
                if how == "whole":
                    (-replay_logprobs(state, model, comp[None], grad=True).mean()).backward()
                else:
                    replay_blocks_backward(state, model, comp, args.block, lambda lp, h: -lp.mean())
            row.update(seconds=t.seconds, peak_gib=peak_gib(), ok=True)
        except torch.OutOfMemoryError as e:
            row.update(ok=False, error=f"OOM: {str(e).splitlines()[0][:160]}", peak_gib=peak_gib())
        if how == "blocks":
            row["block_size"] = args.block
        rows.append(row)
    del state
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3.6-27b", choices=["qwen3-8b", "qwen3.6-27b"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, nargs="*", default=[524288, 1048576])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--response", type=int, default=2048)
    ap.add_argument("--modes", nargs="+", default=["full", "response_only"])
    ap.add_argument(
        "--long-response", type=int, default=0, help="R of the block-replay measurement (0: skip)"
    )
    ap.add_argument("--long-prompt", type=int, default=8192)
    ap.add_argument("--block", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--page", type=int, default=16384)
    ap.add_argument("--check", type=int, default=4096, help="prompt tokens of the bf16 check (0: skip)")
    ap.add_argument("--tag", default="")
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        help="profile the first full-mode prompt backward: print its top N kernels",
    )
    ap.add_argument("--smoke", action="store_true", help="dry run on CPU with tiny dimensions")
    args = ap.parse_args()
    if args.smoke:  # every size small: the whole script in seconds on a CPU
        args.prompt, args.groups, args.response, args.chunk, args.page, args.check = [512], 2, 8, 128, 64, 256
        args.long_response, args.long_prompt, args.block = 48, 64, 16
    dev = "cpu" if args.smoke else "cuda"
    longest = max([*args.prompt, args.check, args.long_prompt]) + max(args.response, args.long_response)
    torch.manual_seed(0)
    config = slice_config(args.preset, args.layers, longest + 16, tiny=args.smoke)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.train()
    payload = {
        "model": f"{args.preset} layer dimensions, {args.layers} layers, random init, bf16, full fine-tuning",
        "preset": args.preset,
        "layers": args.layers,
        "groups": args.groups,
        "response_tokens": args.response,
        "chunk_size": args.chunk,
        "page_size": args.page,
        "gdn_boundary_states": "kept at every capture-chunk boundary (not recomputed)",
        "steps": [],
        "long_response": [],
    }
    name = f"full_gradient_{args.preset}_{args.layers}L{args.tag}"
    t0 = time.perf_counter()
    if args.prompt or args.long_response:  # warm-up at the run's shapes: Triton kernels compile on first use
        warm = torch.randint(0, config.vocab_size, (2 * args.chunk,), device=dev)
        state = capture_prompt(model, warm, chunk_size=args.chunk, page_size=args.page, keep_boundaries=True)
        grads = StateGrads(state)
        replay_logprobs(
            state, model, warm[None, : min(args.response, 512)], grad=True, grads=grads
        ).mean().backward()
        prompt_backward(state, model, grads, progress=False)
        del state, grads
        model.zero_grad(set_to_none=True)
        payload["warm_up_s"] = time.perf_counter() - t0
    if args.check:
        payload["check_bf16"] = check_full_gradient(
            model,
            config.vocab_size,
            dev,
            args.check,
            min(256, args.response),
            min(args.chunk, args.check // 4),
        )
        write_result(name, payload)
        print(f"bf16 check (P={args.check}): {payload['check_bf16']}", flush=True)
    for p in args.prompt:
        for mode in args.modes:
            payload["steps"].append(step(model, config, args, p, dev, mode))
            write_result(name, payload)
            print(f"P={p} {mode}: {payload['steps'][-1]}", flush=True)
    if args.long_response:
        payload["long_response"] = long_response(model, config, args, dev)
        path = write_result(name, payload)
        print(f"long response: {payload['long_response']}", flush=True)
    path = write_result(name, payload)
    rows = [
        {
            "P": s["prompt_tokens"],
            "mode": s["mode"],
            "capture s": f"{s['capture_s']:.1f}",
            "replays s": f"{s['replay_s_total']:.1f}",
            "prompt bwd s": f"{s['prompt_backward_s']:.1f}",
            "step s": f"{s['step_s']:.1f}",
            "replay peak GiB": f"{s['replay_peak_gib']:.1f}",
            "prompt bwd peak GiB": f"{s.get('prompt_backward_peak_gib', float('nan')):.1f}",
            "grad buf GiB": f"{s.get('gradient_buffer_bytes', 0) / GiB:.2f}",
            "kept GDN GiB": f"{s.get('kept_boundary_bytes', 0) / GiB:.2f}",
        }
        for s in payload["steps"]
    ]
    print_table(rows)
    print_table(
        [
            {
                "R": r["response_tokens"],
                "replay": r["replay"],
                "ok": r["ok"],
                "s": f"{r.get('seconds', float('nan')):.1f}",
                "peak GiB": f"{r['peak_gib']:.1f}",
            }
            for r in payload["long_response"]
        ]
    )
    for s in payload["steps"]:
        if s.get("prompt_backward_profile"):
            print(f"prompt backward, P={s['prompt_tokens']}: top kernels by device time")
            print_table(
                [
                    {**r, "self_s": f"{r['self_s']:.2f}", "share": f"{r['share']:.1%}"}
                    for r in s["prompt_backward_profile"]
                ]
            )
    print(f"wrote {path} in {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
