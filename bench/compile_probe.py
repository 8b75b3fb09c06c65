"""Probe: would compiling the decoder layers for the graph-free passes (capture, decode) pay?

Not part of the library. Builds a Qwen3.6-27B slice (real widths, bf16, LoRA r=64 on every linear layer),
then times a warm capture and a warm decode step with the stock layer forward and with each layer
class's forward under ``torch.compile`` (graph breaks allowed), and prints how far the compiled capture's
state and decode logits are from the eager ones.

    python bench/compile_probe.py --layers 8 --prompt 65536
"""

from __future__ import annotations

import argparse
import time

import torch
from common import write_result
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

import longstraw_trl.hooks as hooks
from longstraw_trl import capture_prompt, generate_from_state
from longstraw_trl.context import CTX_KWARG, Mode
from longstraw_trl.presets import preset_config

_COMPILED: dict[type, object] = {}
_USE = {"on": False}
_STOCK_LAYER_FORWARD = hooks._layer_forward


def _compiled_layer_forward(self, *args, **kwargs):
    ctx = kwargs.get(CTX_KWARG)
    if (
        _USE["on"]
        and ctx is not None
        and ctx.mode in (Mode.CAPTURE, Mode.DECODE)
        and not torch.is_grad_enabled()
    ):
        fn = _COMPILED.get(type(self))
        if fn is None:
            fn = _COMPILED[type(self)] = torch.compile(type(self).forward, dynamic=False)
        return fn(self, *args, **kwargs)
    return _STOCK_LAYER_FORWARD(self, *args, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=65536)
    ap.add_argument("--chunk", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    hooks._layer_forward = _compiled_layer_forward  # bound per instance by patch_model below
    config = preset_config("qwen3.6-27b", args.layers, max_position_embeddings=args.prompt + 4096)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=64, lora_alpha=128, target_modules="all-linear"))
    model.eval()
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    prompt = torch.randint(0, config.vocab_size, (args.prompt,), device="cuda")

    def timed(fn):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return out, time.perf_counter() - t

    results = {}
    states = {}
    for mode in ("eager", "compiled"):
        _USE["on"] = mode == "compiled"
        with torch.no_grad():
            _, first = timed(lambda: capture_prompt(model, prompt, chunk_size=args.chunk, progress=False))
            state, warm = timed(lambda: capture_prompt(model, prompt, chunk_size=args.chunk, progress=False))
            gen = torch.Generator(device="cuda").manual_seed(0)
            generate_from_state(state, model, 8, 16, generator=gen)  # warm-up (graph capture, compile)
            gen = torch.Generator(device="cuda").manual_seed(0)
            ids, dec = timed(lambda s=state, g=gen: generate_from_state(s, model, 8, args.steps, generator=g))
        states[mode] = state
        results[mode] = {
            "first_capture_s": first,
            "capture_s": warm,
            "decode_ms_per_step": 1e3 * dec / args.steps,
        }
        print(mode, results[mode], flush=True)
    diffs = []
    for a, b in zip(states["eager"].layers.values(), states["compiled"].layers.values(), strict=True):
        ta = torch.cat([t.float().flatten() for t in a.tensors()])
        tb = torch.cat([t.float().flatten() for t in b.tensors()])
        diffs.append(((ta - tb).norm() / ta.norm()).item())
    results["state_rel_diff_per_layer"] = diffs
    results["capture_speedup"] = results["eager"]["capture_s"] / results["compiled"]["capture_s"]
    results["decode_speedup"] = (
        results["eager"]["decode_ms_per_step"] / results["compiled"]["decode_ms_per_step"]
    )
    write_result(
        "compile_probe_qwen3.6-27b", {"layers": args.layers, "prompt_tokens": args.prompt, **results}
    )
    print("mode     | capture s | decode ms/step")
    for mode in ("eager", "compiled"):
        r = results[mode]
        print(f"{mode:8} | {r['capture_s']:9.2f} | {r['decode_ms_per_step']:8.2f}")
    print(
        f"speedup capture {results['capture_speedup']:.2f}x decode {results['decode_speedup']:.2f}x; "
        f"state rel diff max {max(diffs):.2e}"
    )


if __name__ == "__main__":
    main()
