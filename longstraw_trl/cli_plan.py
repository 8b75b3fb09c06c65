"""``longstraw plan``: the per-rank memory budget of a LongStraw GRPO step, whether it fits the GPU (and, offloaded,
the host), and whether the model's positions take prompt + response. ``longstraw_trl.cli`` loads this module when the
command runs: it imports the planner (torch, transformers)."""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import sys
from pathlib import Path

from .constants import (
    AUTO,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_PAGE_SIZE,
    PREFIX_SHARING_MODES,
    PrefixSharing,
    preferred_if_auto,
)
from .errors import LongStrawError, UnsupportedModelError
from .planner import (
    DEFAULT_HOST_MEMORY_GIB,
    DEFAULT_RANKS_PER_HOST,
    GPU_MEMORY_GIB,
    MemoryPlan,
    PlanInputs,
    PositionCheck,
    check_plannable,
    check_positions,
    format_plan,
    format_positions,
    format_suggestions,
    largest_prompt,
)
from .preflight import plan_step
from .presets import PRESETS, preset_config

DESCRIPTION = (
    "Per-rank memory budget of a LongStraw GRPO step, whether it fits the GPU (and, offloaded, the host), and "
    "whether the model's positions (max_position_embeddings, RoPE scaling) take prompt + response."
)


def main(argv: list[str]) -> int:
    """Run ``longstraw plan`` on ``argv``: 0 if the step runs, 1 if it does not fit (or its positions do not
    reach), 2 on bad input (one line on stderr naming what to change)."""
    args = build_parser().parse_args(argv)
    try:
        return plan(args)
    except LongStrawError as e:  # bad input: one line naming what to change, no traceback
        print(f"longstraw plan: error: {e}", file=sys.stderr)
        return 2


# ----------------------------------------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="longstraw plan", description=DESCRIPTION)
    ap.add_argument("model", help=f"a local HF config/model directory, or a preset: {', '.join(PRESETS)}")
    size = ap.add_mutually_exclusive_group(required=True)
    size.add_argument("--prompt", type=int, help="prompt tokens P")
    size.add_argument(
        "--max-prompt", action="store_true", help="find the largest P that fits, and plan that P"
    )
    _add_step_options(ap)
    _add_hardware_options(ap)
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    return ap


def _add_step_options(ap: argparse.ArgumentParser) -> None:
    """The step's options: the trainer's, under their command-line names."""
    ap.add_argument(
        "--generations",
        type=int,
        default=8,
        help="G (the peak grows with the responses replayed together, see --replay-batch-tokens)",
    )
    ap.add_argument("--response", type=int, default=2048, help="completion tokens R")
    ap.add_argument("--cp", type=int, default=1, help="context-parallel ranks sharing the prompt pages")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel ranks sharing the experts")
    ap.add_argument(
        "--fsdp",
        type=int,
        default=0,
        help="ranks the policy is sharded over with FSDP2 (weights, gradients, optimizer states; with --cp: the same "
        "ranks, examples/accelerate/fsdp2_cp8.yaml); 1: FSDP2 on one GPU (its gathered copies are overhead); "
        "0 (default): not wrapped",
    )
    ap.add_argument("--lora-rank", type=int, default=None, help="LoRA rank (default: full fine-tuning)")
    ap.add_argument("--optimizer", choices=["adamw", "none"], default="adamw")
    ap.add_argument("--layers", type=int, default=None, help="plan a slice with this many layers")
    # the trainer's own defaults (LongStrawGRPOConfig.capture_chunk_size / page_size): the plan is of what it runs
    ap.add_argument(
        "--chunk-size",
        type=_int_or_auto,
        default=DEFAULT_CHUNK_SIZE,
        help=f"capture_chunk_size (default {DEFAULT_CHUNK_SIZE}, the trainer's preferred); auto: the trainer's "
        "'auto', the largest power of two down from it that fits",
    )
    ap.add_argument(
        "--page-size",
        type=int,
        default=DEFAULT_PAGE_SIZE,
        help=f"page_size (default {DEFAULT_PAGE_SIZE}, the trainer's)",
    )
    ap.add_argument(
        "--checkpoint-layers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replays recompute each decoder layer in backward (default, as under TRL's default "
        "gradient_checkpointing=True); --no-checkpoint-layers plans without it",
    )
    ap.add_argument(
        "--prompt-backward-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--gradient-mode full: the prompt backward's recomputed chunk checkpoints its layers (default: as "
        "--checkpoint-layers); --no-prompt-backward-checkpointing keeps every layer's graph over a chunk "
        "(LongStrawGRPOConfig.prompt_backward_checkpoint_layers=False)",
    )
    ap.add_argument(
        "--gradient-mode",
        choices=["response_only", "full"],
        default="response_only",
        help="full: add the full gradient's dK/dV buffers, kept GDN boundary states and page-gradient workspace",
    )
    ap.add_argument(
        "--prefix-sharing",
        dest="prompt_prefix_sharing",
        nargs="?",
        choices=list(PREFIX_SHARING_MODES),
        const=PrefixSharing.ALL.value,
        default=PrefixSharing.BATCH.value,
        help="the trainer's prompt_prefix_sharing (default: batch); 'all' (the flag alone) adds the GDN / window "
        "states it keeps at every capture-chunk boundary",
    )
    ap.add_argument(
        "--no-prefix-sharing",
        dest="prompt_prefix_sharing",
        action="store_const",
        const=PrefixSharing.OFF.value,
        help="--prefix-sharing off",
    )
    ap.add_argument(
        "--replay-batch-tokens",
        type=_int_or_auto,
        default=8192,
        help="responses replayed together while responses x R stays within this (the trainer's option; 0: one); "
        "auto: the trainer's 'auto', 8192 or less, the first that fits",
    )


def _add_hardware_options(ap: argparse.ArgumentParser) -> None:
    """The GPU and the host memory an offloaded prompt state may pin."""
    ap.add_argument("--gpu", default="h200", help=f"one of {', '.join(GPU_MEMORY_GIB)}, or GiB as a number")
    ap.add_argument(
        "--offload",
        dest="offload_prompt_state",
        choices=["cpu", "auto"],
        default=None,
        help="keep the prompt state in pinned host memory (the trainer's offload_prompt_state='cpu'); it must fit "
        "this rank's share of --host-memory. auto: the trainer's default, its pre-flight plan's choice (on the "
        "device where that fits, else offloaded where that fits)",
    )
    ap.add_argument(
        "--keep-layers-on-device",
        action="store_true",
        help="with the state offloaded: keep whole layers of it on the device within 90%% of the GPU memory the plan "
        "leaves free, as the trainer does (its offload_keep_layers_on_device=True); off by default here, so that the "
        "peak is what the step needs",
    )
    ap.add_argument(
        "--host-memory",
        type=float,
        default=DEFAULT_HOST_MEMORY_GIB,
        metavar="GiB",
        help="memory of one host, in GiB, that its ranks may pin for an offloaded prompt state (default "
        f"{DEFAULT_HOST_MEMORY_GIB:g}: a DGX H200's 2 TiB); --offload cpu is planned and suggested only within "
        "--host-memory / --ranks-per-host a rank",
    )
    ap.add_argument(
        "--ranks-per-host",
        type=int,
        default=DEFAULT_RANKS_PER_HOST,
        help=f"ranks (GPUs) sharing one host's memory (default {DEFAULT_RANKS_PER_HOST})",
    )


def _did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(word.lower(), list(choices), n=3)
    return f"did you mean {', '.join(close)}? " if close else ""


def _parse_gpu(text: str) -> float:
    """``--gpu``: a known GPU's name or its memory in GiB."""
    if text.lower() in GPU_MEMORY_GIB:
        return GPU_MEMORY_GIB[text.lower()]
    try:
        gib = float(text)
    except ValueError:
        gib = None
    if gib is not None and math.isfinite(gib) and gib > 0:
        return gib
    known = ", ".join(f"{k} ({v} GiB)" for k, v in GPU_MEMORY_GIB.items())
    raise LongStrawError(
        f"--gpu {text!r} is neither a known GPU nor a positive number of GiB; {_did_you_mean(text, GPU_MEMORY_GIB)}"
        f"known GPUs: {known}; or give the memory in GiB, e.g. --gpu 80"
    )


def _read_config(source: str):
    """A local directory's (or a cached Hub model's) config; LongStrawError saying what is wrong otherwise."""
    from transformers import AutoConfig

    presets = ", ".join(PRESETS)
    path = Path(source).expanduser()
    if path.is_dir():
        file = path / "config.json"
        if not file.is_file():
            raise LongStrawError(
                f"{source}: no config.json in this directory; MODEL is a Hugging Face model or config "
                f"directory, or a preset: {presets}"
            )
        try:
            return AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            try:
                model_type = json.loads(file.read_text()).get("model_type")
            except ValueError:  # not JSON: transformers' own message says so
                model_type = None
            if model_type:  # a type transformers does not know has no LongStraw patch either
                _check_model_type(model_type, file)
            raise LongStrawError(f"{file}: {str(e).splitlines()[0]}") from None
    if path.exists():
        raise LongStrawError(
            f"{source} is a file; MODEL is a directory holding config.json, or a preset: {presets}"
        )
    try:  # a Hub id already in the local cache (nothing is downloaded)
        return AutoConfig.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError):
        pass
    if os.sep in source or "/" in source or source.startswith((".", "~")):
        raise LongStrawError(
            f"no such directory: {source} (nor a Hugging Face model in the local cache); MODEL is a directory "
            f"holding config.json, or a preset: {presets}"
        )
    raise LongStrawError(
        f"unknown preset {source!r}; {_did_you_mean(source, PRESETS)}presets: {presets} "
        "(or a directory holding a Hugging Face config.json)"
    )


def _check_model_type(model_type: str | None, source) -> None:
    try:
        check_plannable(model_type)
    except UnsupportedModelError as e:  # say which config, before any planning
        raise UnsupportedModelError(f"{source}: {e}") from None


def _load_config(name_or_path: str, layers: int | None):
    if name_or_path in PRESETS:
        return preset_config(name_or_path, layers)
    config = _read_config(name_or_path)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    _check_model_type(config.model_type, name_or_path)
    if layers:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
    return config


# ----------------------------------------------------------------------------------------------------------------------
# Planning
# ----------------------------------------------------------------------------------------------------------------------
POSITIVE_OPTIONS = (
    "prompt",
    "generations",
    "response",
    "cp",
    "ep",
    "lora_rank",
    "layers",
    "chunk_size",
    "page_size",
    "ranks_per_host",
)


def _int_or_auto(text: str) -> int | str:
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an int or 'auto', got {text!r}") from None


def _auto_names(a: argparse.Namespace) -> tuple[str, ...]:
    """The options given as ``auto``, by the :class:`PlanInputs` fields they set."""
    given = (("capture_chunk_size", a.chunk_size), ("replay_batch_tokens", a.replay_batch_tokens))
    return tuple(name for name, value in given if value == AUTO)


def _check_values(a: argparse.Namespace) -> None:
    for flag in POSITIVE_OPTIONS:
        value = getattr(a, flag)
        if value is not None and value != AUTO and value < 1:
            raise LongStrawError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if a.fsdp < 0:
        raise LongStrawError(f"--fsdp must be >= 0 (0: not wrapped), got {a.fsdp}")
    if a.replay_batch_tokens != AUTO and a.replay_batch_tokens < 0:
        raise LongStrawError(f"--replay-batch-tokens must be >= 0, got {a.replay_batch_tokens}")
    if not (math.isfinite(a.host_memory) and a.host_memory > 0):
        raise LongStrawError(f"--host-memory must be a positive number of GiB, got {a.host_memory}")


def plan_inputs(a: argparse.Namespace) -> PlanInputs:
    """The planner's inputs that the options describe."""
    return PlanInputs(
        num_generations=a.generations,
        max_completion_length=a.response,
        cp_size=a.cp,
        ep_size=a.ep,
        fsdp_size=a.fsdp,
        lora_rank=a.lora_rank,
        optimizer=a.optimizer,
        gpu_memory_gib=_parse_gpu(a.gpu),
        capture_chunk_size=preferred_if_auto("capture_chunk_size", a.chunk_size),
        page_size=a.page_size,
        replay_checkpoint_layers=a.checkpoint_layers,
        prompt_backward_checkpoint_layers=a.prompt_backward_checkpointing,
        replay_batch_tokens=preferred_if_auto("replay_batch_tokens", a.replay_batch_tokens),
        gradient_mode=a.gradient_mode,
        prompt_prefix_sharing=a.prompt_prefix_sharing,
        offload_prompt_state=None if a.offload_prompt_state == "auto" else a.offload_prompt_state,
        host_memory_gib=a.host_memory / a.ranks_per_host,
    )


def _largest_prompt(a: argparse.Namespace, config, inputs: PlanInputs, preset: bool) -> int:
    """``--max-prompt``: the largest prompt that fits and that the model's positions take (one page if none fits)."""
    offloads = [None, "cpu"] if a.offload_prompt_state == "auto" else [inputs.offload_prompt_state]
    prompt = max(largest_prompt(config, PlanInputs.of(inputs, offload_prompt_state=o)) for o in offloads)
    if not a.json:
        print(f"largest prompt that fits: {prompt:,} tokens ({prompt // a.page_size} pages of {a.page_size})")
    limit = None if preset else check_positions(config, prompt, a.response).limit
    if limit is not None and prompt + a.response > limit and limit > a.response:
        prompt = limit - a.response
        if not a.json:
            print(
                f"the model's positions allow at most {prompt:,} prompt tokens (with --response {a.response})"
            )
    return prompt or a.page_size  # with none: show why even one page does not fit


def plan(a: argparse.Namespace) -> int:
    """Plan the step ``a`` describes and print the plan; 0 if it runs, 1 otherwise."""
    _check_values(a)
    inputs = plan_inputs(a)
    config = _load_config(a.model, a.layers)
    # a preset has a model's dimensions, not its released position limit (transformers' default
    # max_position_embeddings): only a config of the model itself says which positions it takes
    preset = a.model in PRESETS
    prompt = _largest_prompt(a, config, inputs, preset) if a.max_prompt else a.prompt
    # the trainer's pre-flight decision (with --offload auto, its choice); with --max-prompt a smaller --prompt is
    # no change (and the two flags exclude each other)
    decision = plan_step(
        config,
        prompt,
        inputs,
        a.offload_prompt_state,
        vary_prompt=not a.max_prompt,
        keep_on_device=a.keep_layers_on_device,
        auto=_auto_names(a),
    )
    memory, suggestions = decision.plan, decision.suggestions
    positions = None if preset else check_positions(config, prompt, a.response)
    runs = memory.fits and (positions is None or positions.ok)
    chosen = {"offload_chosen": decision.offload_prompt_state} if a.offload_prompt_state == "auto" else {}
    if _auto_names(a):
        chosen["auto_settings"] = {name: getattr(decision.inputs, name) for name in _auto_names(a)}
    if a.json:
        print_json(a, prompt, memory, suggestions, positions, runs, chosen)
    else:
        if "offload_chosen" in chosen:
            print(
                f"offload_prompt_state='auto': the prompt state {decision.placement}, since {decision.reason()}"
            )
        if "auto_settings" in chosen:
            print("'auto' settings: " + ", ".join(f"{k}={v}" for k, v in chosen["auto_settings"].items()))
        print_text(a, memory, suggestions, positions)
    return 0 if runs else 1


# ----------------------------------------------------------------------------------------------------------------------
# Printing
# ----------------------------------------------------------------------------------------------------------------------
def print_json(
    a: argparse.Namespace,
    prompt: int,
    memory: MemoryPlan,
    suggestions: list,
    positions: PositionCheck | None,
    runs: bool,
    extra: dict | None = None,
) -> None:
    out = memory.as_dict()
    out.update(extra or {})
    out["prompt_tokens"] = prompt
    if a.max_prompt:
        out["largest_prompt_tokens"] = prompt if memory.fits else 0
    out["suggestions"] = [s.as_dict() for s in suggestions]
    out["positions"] = positions.as_dict() if positions else None
    out["runs"] = runs
    print(json.dumps(out, indent=2))


def print_text(
    a: argparse.Namespace, memory: MemoryPlan, suggestions: list, positions: PositionCheck | None
) -> None:
    print(format_plan(memory))
    if not memory.fits:
        print(format_suggestions(suggestions, memory.gpu_bytes))
    if positions is None:
        print(
            f"positions           not checked: the preset {a.model!r} has the model's dimensions, not its\n"
            "  position limit (plan the model's config directory to check max_position_embeddings and RoPE)"
        )
    else:
        print(format_positions(positions))
