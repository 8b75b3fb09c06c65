"""``longstraw`` command line (also ``python -m longstraw_trl``)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .planner import GPU_MEMORY_GIB, format_plan, largest_prompt, plan_memory
from .presets import PRESETS, preset_config


def _load_config(name_or_path: str, layers: int | None):
    if name_or_path in PRESETS:
        return preset_config(name_or_path, layers)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(name_or_path, local_files_only=True)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if layers:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
    return config


def plan_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="longstraw plan",
        description="Per-rank memory budget of a LongStraw GRPO step, and whether it fits the GPU.",
    )
    ap.add_argument("model", help=f"a local HF config/model directory, or a preset: {', '.join(PRESETS)}")
    size = ap.add_mutually_exclusive_group(required=True)
    size.add_argument("--prompt", type=int, help="prompt tokens P")
    size.add_argument(
        "--max-prompt", action="store_true", help="find the largest P that fits, and plan that P"
    )
    ap.add_argument("--generations", type=int, default=8, help="G (does not change the peak)")
    ap.add_argument("--response", type=int, default=2048, help="completion tokens R")
    ap.add_argument("--cp", type=int, default=1, help="context-parallel ranks sharing the prompt pages")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel ranks sharing the experts")
    ap.add_argument("--lora-rank", type=int, default=None, help="LoRA rank (default: full fine-tuning)")
    ap.add_argument("--optimizer", choices=["adamw", "none"], default="adamw")
    ap.add_argument("--layers", type=int, default=None, help="plan a slice with this many layers")
    ap.add_argument("--gpu", default="h200", help=f"one of {', '.join(GPU_MEMORY_GIB)}, or GiB as a number")
    ap.add_argument("--chunk-size", type=int, default=16384)
    ap.add_argument("--page-size", type=int, default=16384)
    ap.add_argument("--checkpoint-layers", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    a = ap.parse_args(argv)
    if a.prompt is not None and a.prompt < 1:
        ap.error(f"--prompt must be >= 1, got {a.prompt}")
    gpu = GPU_MEMORY_GIB[a.gpu] if a.gpu in GPU_MEMORY_GIB else float(a.gpu)
    config = _load_config(a.model, a.layers)
    options = dict(
        num_generations=a.generations,
        response_tokens=a.response,
        cp_size=a.cp,
        ep_size=a.ep,
        lora_rank=a.lora_rank,
        optimizer=a.optimizer,
        gpu_memory_gib=gpu,
        capture_chunk_size=a.chunk_size,
        checkpoint_layers=a.checkpoint_layers,
    )
    prompt = a.prompt
    if a.max_prompt:
        prompt = largest_prompt(config, page_size=a.page_size, **options)
        if not a.json:
            print(
                f"largest prompt that fits: {prompt:,} tokens ({prompt // a.page_size} pages of {a.page_size})"
            )
        if prompt == 0:
            prompt = a.page_size  # show why even one page does not fit
    plan = plan_memory(config, prompt, page_size=a.page_size, **options)
    if a.json:
        out = plan.as_dict()
        out["prompt_tokens"] = prompt
        if a.max_prompt:
            out["largest_prompt_tokens"] = prompt if plan.fits else 0
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(plan))
    return 0 if plan.fits else 1


def main(argv: list[str] | None = None) -> int:
    try:
        status = _main(argv)
        sys.stdout.flush()  # inside the try: a buffered stdout would otherwise fail at interpreter exit
        return status
    except BrokenPipeError:  # output piped into e.g. `head`: stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: longstraw plan MODEL --prompt P [...]   (longstraw plan -h for options)")
        return 0
    if argv[0] == "plan":
        return plan_main(argv[1:])
    print(f"unknown command {argv[0]!r}; available: plan", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
