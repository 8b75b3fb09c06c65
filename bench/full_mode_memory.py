"""Where the full gradient's memory goes on the whole model (issue 25): the engine's phases one by one.

``gradient_mode="full"`` ran out of memory through ``train()`` on the whole Qwen3.6-27B (LoRA r = 64, bf16) at
P = 16,384 with R = 32, where the response-only step peaked at 58.7 GiB (``full_model_qwen3.6-27b_fullmode_mem2.json``).
This probe runs the same work through the engine without a trainer, with the engine's layer checkpointing as the
trainer uses it under TRL's defaults, and records the allocated and peak bytes after each phase: capture (keeping
the GDN boundary states), G replays with backward accumulating the state's gradient, the prompt backward. On an
out-of-memory it records the phase, ``torch.cuda.memory_summary()`` and the largest live CUDA tensors.

    python bench/full_mode_memory.py --prompt 16384 --response 32
    python bench/full_mode_memory.py --tiny     # CPU dry run
"""

from __future__ import annotations

import argparse
import gc
import traceback

import torch
from common import GiB, Timer, write_result
from engine_slice import slice_config
from full_model import build_model
from peft import LoraConfig, get_peft_model

from longstraw_trl import capture_prompt, replay_logprobs
from longstraw_trl.engine import StateGrads, prompt_backward


def _gib(x: int) -> float:
    return round(x / GiB, 3)


def _memory() -> dict:
    if not torch.cuda.is_available():
        return {}
    return {
        "allocated_gib": _gib(torch.cuda.memory_allocated()),
        "peak_gib": _gib(torch.cuda.max_memory_allocated()),
    }


def _largest_tensors(n: int = 25) -> list[dict]:
    """The largest live CUDA tensors reachable by the garbage collector (shape, dtype, GiB)."""
    seen, out = set(), []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                storage = obj.untyped_storage()
                key = storage.data_ptr()
                if key in seen:
                    continue
                seen.add(key)
                out.append({"shape": list(obj.shape), "dtype": str(obj.dtype), "gib": _gib(storage.nbytes())})
        except Exception:  # noqa: BLE001, S112 - objects that are not plain tensors
            continue
    return sorted(out, key=lambda t: -t["gib"])[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3.6-27b")
    ap.add_argument("--layers", type=int, default=None, help="default: the whole model")
    ap.add_argument("--prompt", type=int, default=16384)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=16384)
    ap.add_argument("--lora-rank", type=int, default=64)
    ap.add_argument("--no-checkpoint-layers", action="store_true")
    ap.add_argument("--tag", default="")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    if args.tiny:
        args.prompt, args.response, args.generations, args.chunk, args.lora_rank = 300, 8, 2, 128, 8
    dev, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    config = slice_config(
        args.preset, args.layers or (4 if args.tiny else None), args.prompt + args.response + 16, args.tiny
    )
    model = build_model(config, dev, dtype)
    model = get_peft_model(
        model, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules="all-linear")
    )
    model.train()
    checkpoint_layers = not args.no_checkpoint_layers
    result = {
        "preset": args.preset,
        "layers": config.num_hidden_layers,
        "prompt_tokens": args.prompt,
        "response_tokens": args.response,
        "generations": args.generations,
        "capture_chunk_size": args.chunk,
        "lora_rank": args.lora_rank,
        "checkpoint_layers": checkpoint_layers,
        "weights": _memory(),
        "phases": [],
    }
    name = f"full_mode_memory_{args.preset}{'_tiny' if args.tiny else ''}{args.tag}"
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (args.prompt,), generator=gen)
    ids = torch.randint(0, config.vocab_size, (args.generations, args.response), generator=gen).to(dev)
    phase = "capture"

    def record(what: str, seconds: float, **extra) -> None:
        result["phases"].append({"phase": what, "seconds": round(seconds, 3), **_memory(), **extra})
        write_result(name, result)
        print(result["phases"][-1], flush=True)

    try:
        with Timer() as t, torch.no_grad():
            state = capture_prompt(model, prompt, chunk_size=args.chunk, keep_boundaries=True)
        record(phase, t.seconds, state_gib=_gib(state.nbytes()))
        grads = StateGrads(state)
        for i in range(args.generations):
            phase = f"replay {i} forward"
            with Timer() as t:
                logps = replay_logprobs(
                    state, model, ids[i : i + 1], grad=True, checkpoint_layers=checkpoint_layers, grads=grads
                )
            record(phase, t.seconds)
            phase = f"replay {i} backward"
            with Timer() as t:
                logps.sum().backward()
            del logps
            record(phase, t.seconds, state_grad_gib=_gib(grads.nbytes()))
        phase = "prompt backward"
        with Timer() as t:
            prompt_backward(state, model, grads, checkpoint_layers=checkpoint_layers)
        record(phase, t.seconds)
        result["ok"] = True
    except torch.OutOfMemoryError as exc:
        result["ok"] = False
        result["oom_phase"] = phase
        result["oom"] = str(exc).split("\n")[0]
        result["at_oom"] = _memory()
        result["largest_tensors_at_oom"] = _largest_tensors()
        result["memory_summary"] = torch.cuda.memory_summary(abbreviated=True)
        traceback.print_exc()
    write_result(name, result)
    print("ok" if result.get("ok") else f"OOM in {result['oom_phase']}: {result.get('at_oom')}")
    for t in result.get("largest_tensors_at_oom", [])[:12]:
        print(t)


if __name__ == "__main__":
    main()
