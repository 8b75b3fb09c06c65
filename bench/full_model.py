"""The whole model: Qwen3.6-27B (64 layers, 48 GDN + 16 full attention), LoRA r=64, one H200.

LongStraw: ``LongStrawGRPOTrainer.train()`` runs one GRPO step per prompt length P (capture, G = 8
generations of exactly R tokens, G replays with backward, optimizer step), after one warm-up step at a
small P that takes compilation and first calls out of the measurement. A fresh trainer per P shares the
PEFT model of the first one (LoRA goes in through its ``peft_config``). Phase seconds are the trainer's
own ``longstraw/*`` metrics; each stands beside its floor, from rates measured in this process:

- capture: 2 FLOP per decoder parameter (LoRA included, no output head) per token at the GEMM rate,
  plus the causal attention of the full-attention layers (2 P^2 Hq d FLOPs each) at the attention rate;
- generation: R decode steps, each reading every weight but the input embedding, and the prompt state
  (K/V pages + GDN states), once for all G rows, at the copy bandwidth;
- replay (per response, x G): the larger of FLOPs (forward + input gradient, 4 per frozen parameter per
  token, 6 per LoRA parameter; attention 10 Hq d per response-prompt pair: forward and dQ, the prompt
  K/V are constants) and bytes (weights read three times, the state twice).
GDN recurrences and the optimizer (LoRA parameters only) are not counted. The peak stands beside
``longstraw_trl.planner.plan_memory``'s prediction.

Stock: TRL's ``GRPOTrainer`` (its defaults: activation checkpointing on) on the same PEFT model, one
``prompt + completion`` sequence per step (``compute_loss`` + backward, ``compare_stock.stock_step``), at
growing P until it runs out of memory. Random weights (transformers' init, ``initializer_range``), bf16.

Under ``--budget-s`` (the whole script) a step whose estimate exceeds the time left is recorded as
skipped. LongStraw: each phase's seconds over floor at the previous measured P, times this P's floors; the
first measured P always runs (the warm-up's timings hold the compilation). Stock: the previous step's
seconds (the first: a warm-up at 1K) scaled by the forward floor. JSON is written before (``running``)
and after every step, so a run cut short keeps what it measured.

    python bench/full_model.py                       # LongStraw at 512K and 1M, then stock from 32K
    python bench/full_model.py --skip-stock --prompts 524288 --response 256
    python bench/full_model.py --tiny                # CPU dry run of the same code path
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import importlib.util
import os
import random
import shutil
import string
import sys
import tempfile
import time
import traceback
import warnings
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
from common import (
    GiB,
    Timer,
    allocated_gib,
    attention_backward_tflops_at,
    attention_tflops_at,
    bandwidth_gbs_at,
    gemm_tflops_at,
    kernel_families,
    kernel_profiler,
    peak_gib,
    print_table,
    reset_peak,
    sync,
    top_kernels,
    top_ops,
    write_result,
)
from compare_stock import attempt, build_trainers, stock_step
from datasets import Dataset
from engine_slice import full_attention_layers, slice_config
from glm_slice import slice_config as glm_slice_config
from peft import LoraConfig
from transformers import AutoModelForCausalLM, TrainerCallback
from transformers.trainer_callback import PrinterCallback

from longstraw_trl import LongStrawGRPOConfig, LongStrawGRPOTrainer, PromptState
from longstraw_trl import engine as longstraw_engine
from longstraw_trl.constants import AUTO_PREFERRED, EP_IMPLEMENTATIONS
from longstraw_trl.expert_parallel import num_routed_experts
from longstraw_trl.options import plan_options
from longstraw_trl.planner import GPU_MEMORY_GIB, plan_memory
from longstraw_trl.planner import state_bytes as planned_state_bytes
from longstraw_trl.toy_tokenizer import build_toy_tokenizer

# under `accelerate launch` (torchrun's environment); 0 and 1 for a plain `python bench/full_model.py`
RANK, WORLD_SIZE = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))

TINY = dict(  # --tiny defaults (explicit flags still win)
    prompts=[512, 1024],
    stock_prompts=[256, 512],
    generations=2,
    response=8,
    warmup_prompt=256,
    warmup_response=4,
    chunk=128,
    page=128,
    lora_rank=8,
)


#: the trainer's memory settings this script sets, by config name: the options that set them
MEMORY_FLAGS = {
    "capture_chunk_size": "chunk",
    "replay_batch_tokens": "replay_batch_tokens",
    "offload_prompt_state": "offload",
}

#: the memory settings with an "auto" or a default of their own that this script sets only when asked
OTHER_MEMORY_SETTINGS = ("prompt_backward_checkpoint_layers", "offload_keep_layers_on_device")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--preset",
        default="qwen3.6-27b",
        choices=["qwen3.6-27b", "qwen3-8b", "glm-5"],
        help="glm-5: a --layers slice (layer 0 dense, the rest MoE; every indexer its own, as GLM-5's released "
        "config), its phases without floors (glm_slice.py measures GLM-5's against floors on one GPU)",
    )
    ap.add_argument("--prompts", type=int, nargs="+", default=[524288, 1048576])
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument(
        "--warmup-prompt",
        type=int,
        default=None,
        help="P of the warm-up step (0: none, the first P runs cold; default 3 x --chunk: two whole chunks, the "
        "second over a prefix page, then one a token short, the shapes every measured capture runs)",
    )
    ap.add_argument("--warmup-response", type=int, default=32)
    ap.add_argument(
        "--chunk",
        type=int,
        default=None,
        help="capture_chunk_size (default 16384; with --library-defaults 'auto')",
    )
    ap.add_argument(
        "--replay-batch-tokens",
        type=int,
        default=None,
        help="replay_batch_tokens (0: one response at a time; default 8192, with --library-defaults 'auto')",
    )
    ap.add_argument(
        "--library-defaults",
        action="store_true",
        help="the trainer's memory settings left at LongStrawGRPOConfig's defaults: offload_prompt_state, "
        "capture_chunk_size, replay_batch_tokens and prompt_backward_checkpoint_layers 'auto', chosen by the "
        "pre-flight plan at the first batch (its decision recorded); --offload, --chunk and --replay-batch-tokens "
        "given as well set theirs",
    )
    ap.add_argument(
        "--preflight-gpu-memory-gib",
        type=float,
        default=None,
        help="LongStrawGRPOConfig.preflight_gpu_memory_bytes: the pre-flight plan's GPU memory for the step (default: "
        "what the GPU has free; on the CPU no plan is made without it)",
    )
    ap.add_argument(
        "--fused-kernels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="graph_free_fused_kernels (--no-fused-kernels: HF's norm and MLP forwards in capture and generation)",
    )
    ap.add_argument(
        "--autograd-fused-kernels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="autograd_fused_kernels (--no-autograd-fused-kernels: HF's norm and MLP forwards and their autograd "
        "backward in the replays and the prompt backward)",
    )
    ap.add_argument("--page", type=int, default=16384, help="page_size")
    ap.add_argument(
        "--lora-rank",
        type=int,
        default=64,
        help="LoRA rank on every linear layer; 0: full fine-tuning (every parameter trained; with --skip-stock)",
    )
    ap.add_argument("--stock-prompts", type=int, nargs="+", default=[32768, 65536, 131072, 262144, 524288])
    ap.add_argument("--budget-s", type=float, default=540.0, help="deadline for the whole script")
    ap.add_argument("--skip-stock", action="store_true")
    ap.add_argument(
        "--stock-ignore-estimates",
        action="store_true",
        help="try every stock P even if its time estimate exceeds the budget (to find the OOM edge: a P that "
        "runs out of memory fails early; one that does not is cut by the command's timeout, recorded as running)",
    )
    ap.add_argument("--skip-longstraw", action="store_true")
    ap.add_argument("--tag", default="", help="suffix of the JSON name (keeps earlier runs' files)")
    ap.add_argument(
        "--gradient-modes",
        nargs="+",
        default=["response_only"],
        choices=["response_only", "full"],
        help="gradient_mode of the LongStraw steps: each P runs once per mode, in this order, side by side in one "
        "process (the warm-up runs in the first mode)",
    )
    ap.add_argument(
        "--cp-size",
        type=int,
        default=1,
        help="LongStrawGRPOConfig.cp_size (under `accelerate launch`: cp2.yaml, or fsdp2.yaml for FSDP2 x CP)",
    )
    ap.add_argument(
        "--ep-size",
        type=int,
        default=1,
        help="LongStrawGRPOConfig.ep_size: the routed experts split over this many ranks of each CP group "
        "(transformers' EP; a MoE preset under `accelerate launch`, --cp-size a multiple of it)",
    )
    ap.add_argument(
        "--ep-implementation",
        choices=EP_IMPLEMENTATIONS,
        default=EP_IMPLEMENTATIONS[0],
        help="LongStrawGRPOConfig.ep_implementation",
    )
    ap.add_argument(
        "--offload",
        choices=["cpu"],
        default=None,
        help="offload_prompt_state (pages and kept full-mode states on the host; the planner plans the same)",
    )
    ap.add_argument(
        "--stream-all-layers",
        action="store_true",
        help="with --offload cpu: offload_keep_layers_on_device=False, every layer streams (default: the whole "
        "layers that fit what the pre-flight plan leaves free stay on the GPU)",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="a slice of this many layers through the same train() path (default: the whole model)",
    )
    ap.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="TRL's gradient_checkpointing (its default, on); off to see what checkpointing costs a step",
    )
    ap.add_argument(
        "--prompt-backward-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="LongStrawGRPOConfig.prompt_backward_checkpoint_layers (default: as --gradient-checkpointing); "
        "--no-prompt-backward-checkpointing keeps every layer's graph over a chunk (pair with a small --chunk)",
    )
    ap.add_argument(
        "--profile-segment",
        type=int,
        default=0,
        metavar="N",
        help="full mode: profile the middle recomputed segment of each measured prompt backward (its top N kernels "
        "and kernel families; every segment is timed either way)",
    )
    ap.add_argument("--tiny", action="store_true", help="dry run on CPU, fp32, tiny dimensions and P")
    args = ap.parse_args()
    if args.tiny:
        ap.set_defaults(**TINY)
        args = ap.parse_args()
    if args.lora_rank < 0:
        ap.error(f"--lora-rank {args.lora_rank}: a rank, or 0 for full fine-tuning")
    if args.lora_rank == 0 and not args.skip_stock:
        ap.error("--lora-rank 0 (full fine-tuning) needs --skip-stock: the stock side shares a PEFT model")
    if args.preset == "glm-5" and not args.layers:
        ap.error(
            "--preset glm-5 needs --layers N: every rank builds the whole model before its experts are split"
        )
    if args.preset == "glm-5" and not args.skip_stock:
        ap.error("--preset glm-5 needs --skip-stock: the stock side's time estimates use the dense floors")
    # what the user set, before the bench's own defaults fill in (--library-defaults leaves the rest to the config)
    args.given = {flag for flag in MEMORY_FLAGS.values() if getattr(args, flag) is not None}
    if args.library_defaults and args.stream_all_layers:
        ap.error(
            "--library-defaults keeps offloaded layers on the device where they fit; drop --stream-all-layers"
        )
    # the bench's settings; with --library-defaults, what "auto" prefers (the floors' matmul shapes, the warm-up)
    preferred = (
        (AUTO_PREFERRED["capture_chunk_size"], AUTO_PREFERRED["replay_batch_tokens"])
        if args.library_defaults
        else (16384, 8192)
    )
    args.chunk = preferred[0] if args.chunk is None else args.chunk
    args.replay_batch_tokens = preferred[1] if args.replay_batch_tokens is None else args.replay_batch_tokens
    if args.warmup_prompt is None:
        args.warmup_prompt = 3 * args.chunk
    return args


# ----------------------------------------------------------------------------------------------------
# Model, rates, floors
# ----------------------------------------------------------------------------------------------------
def build_model(config, dev: str, dtype: torch.dtype):
    """Random weights built in place on the device (transformers' init: normal(0, initializer_range))."""
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        raise RuntimeError("random init produced non-finite weights")
    return model


# PEFT (0.21) maps these names, for a MoE model of transformers 5, onto the fused routed-expert weights as well (its
# v4-to-v5 target conversion matches by suffix, so "shared_experts.down_proj" too)
MLP_PROJECTIONS = {"gate_proj", "up_proj", "down_proj"}


def lora_targets(model) -> str | list[str]:
    """LoRA's target modules: every linear layer of a dense model; of a MoE model every linear layer but the MLP
    projections, whose names (and "all-linear") PEFT also maps onto the fused routed experts: split experts take no
    adapter (ExpertParallel refuses one), and the planner counts adapters on the non-expert linears only."""
    if not num_routed_experts(model.config):
        return "all-linear"
    head = model.get_output_embeddings()
    names = {
        n.rsplit(".", 1)[-1]
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not head
    }
    return sorted(names - MLP_PROJECTIONS)


def lora_description(lora: LoraConfig) -> str:
    """What LoRA wraps, as PEFT resolved it (its MoE conversion rewrites ``target_modules`` in place and may add fused
    expert weights as ``target_parameters``)."""
    modules = lora.target_modules
    text = modules if isinstance(modules, str) else "on " + ",".join(sorted(modules))
    return text + (
        f" and the weights {','.join(sorted(lora.target_parameters))}" if lora.target_parameters else ""
    )


def measure_rates(config, chunk: int, dev: str, dtype: torch.dtype, page: int | None = None) -> dict:
    """The floors' denominators, at the model's shapes: MLP GEMMs and attention over one capture chunk, and the page
    backward of a full-mode segment (``chunk`` queries against a ``page``-key page)."""
    h, hd = config.num_attention_heads, config.head_dim
    shapes = [
        (chunk, config.hidden_size, config.intermediate_size),
        (chunk, config.intermediate_size, config.hidden_size),
    ]
    keys = 8 * chunk
    causal = attention_tflops_at(h, hd, chunk, chunk, True, dev, dtype)
    noncausal = attention_tflops_at(h, hd, chunk, keys, False, dev, dtype)
    return {
        "matmul_tflops": gemm_tflops_at(shapes, dev, dtype),
        "matmul_shapes_mkn": shapes,
        "attention_causal_tflops": causal,
        "attention_noncausal_tflops": noncausal,
        "attention_queries": chunk,
        "attention_noncausal_keys": keys,
        # the floors take the fastest attention measured: a floor must not be beaten by the engine's own kernel
        "attention_tflops": max([*causal.values(), *noncausal.values()]),
        "copy_gbs": bandwidth_gbs_at((4 * GiB) if dev == "cuda" else 64 * 2**20, dev),
        # the engine's page backward (dQ dK dV in the floors' FLOPs) at a segment's shape: the rate the prompt
        # backward's attention backward runs at, against the forward's rate the floor assumes
        "attention_backward_tflops": attention_backward_tflops_at(
            config.num_key_value_heads, h, hd, chunk, page or chunk, dev, dtype
        ),
        "attention_backward_queries_keys": [chunk, page or chunk],
    }


# the floors model dense MLPs and full / GDN attention (the Qwen presets); GLM-5's phases (MLA, DSA's indexer and
# selection, routed experts) run without floors here: bench/glm_slice.py measures them against floors of their own
FLOOR_MODEL_TYPES = ("qwen3", "qwen3_5_text")


def prompt_backward_floor_s(
    p: int,
    decoder: int,
    lora: int,
    attn_per_pair: int,
    matmul: float,
    attention: float,
    attention_backward: float | None = None,
) -> float:
    """The full gradient's prompt backward: the prompt recomputed under autograd and back-propagated (dense: 4 FLOP
    per frozen parameter per token, forward and input gradient, 6 per LoRA parameter; causal attention: 2 P^2 Hq d
    forward + 4 P^2 Hq d for dQ, dK, dV per full-attention layer, ``attn_per_pair`` = Hq d x those layers).
    Rates in FLOP/s; ``attention_backward``: the dQ dK dV FLOPs' rate (default: the forward's)."""
    dense = (4 * decoder + 6 * lora) * p / matmul
    pairs = p * p * attn_per_pair
    return dense + 2 * pairs / attention + 4 * pairs / (attention_backward or attention)


class Floors:
    """Lower bounds of each phase from parameter counts, state bytes and the measured rates (``modelled``: the
    config's family is one the floors describe; otherwise :meth:`phases` is empty)."""

    def __init__(self, policy, config, rates: dict, dtype_bytes: int):
        # the PEFT model's base, or the model itself under full fine-tuning
        base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        embed, head = base.get_input_embeddings().weight, base.get_output_embeddings().weight
        params = [p for p in policy.parameters() if p is not embed and p is not head]
        # trained parameters cost 6 FLOP a token forward and backward (dX and dW), frozen ones 4 (dX only): LoRA's
        # adapters, or with full fine-tuning the whole decoder
        self.lora = sum(p.numel() for p in params if p.requires_grad)
        self.head = head.numel()
        self.head_trained = head.requires_grad
        self.decoder = sum(p.numel() for p in params if not p.requires_grad)
        # read per decode step: every weight but the input embedding (a gather); the head's too where it is tied
        self.weight_bytes = sum(p.numel() * p.element_size() for p in [*params, head])
        self.config, self.rates, self.dtype_bytes = config, rates, dtype_bytes
        self.modelled = config.model_type in FLOOR_MODEL_TYPES
        self.attn_per_pair = config.num_attention_heads * config.head_dim * full_attention_layers(config)
        self.matmul, self.attn = rates["matmul_tflops"] * 1e12, rates["attention_tflops"] * 1e12
        self.bandwidth = rates["copy_gbs"] * 1e9

    def state_bytes(self, p: int, page: int) -> int:
        return sum(planned_state_bytes(self.config, p, page_size=page, dtype_bytes=self.dtype_bytes).values())

    def capture(self, p: int) -> float:
        return 2 * (self.decoder + self.lora) * p / self.matmul + 2 * p * p * self.attn_per_pair / self.attn

    def generation(self, r: int, state: int) -> float:
        return r * (self.weight_bytes + state) / self.bandwidth

    def prompt_backward(self, p: int, attention_backward: float | None = None) -> float:
        """:func:`prompt_backward_floor_s` of this model at the measured rates."""
        return prompt_backward_floor_s(
            p, self.decoder, self.lora, self.attn_per_pair, self.matmul, self.attn, attention_backward
        )

    def prompt_backward_at_kernel_rates(self, p: int) -> float | None:
        """:meth:`prompt_backward`'s FLOPs, the attention backward's at the rate the engine's page backward measured
        (``attention_backward_tflops``) rather than the forward's: what the same work costs at the speed of the
        kernels that run it. ``None`` without that rate."""
        bwd = self.rates.get("attention_backward_tflops")
        return self.prompt_backward(p, bwd * 1e12) if bwd else None

    def replay(self, p: int, r: int, state: int) -> float:
        """One response: forward + backward to the trained weights (the head's dW too where it is trained)."""
        dense = (
            (4 * self.decoder + (6 if self.head_trained else 4) * self.head + 6 * self.lora) * r / self.matmul
        )
        flops = dense + 10 * self.attn_per_pair * r * p / self.attn
        return max(flops, (3 * self.weight_bytes + 2 * state) / self.bandwidth)

    def phases(self, p: int, r: int, g: int, state: int, full: bool) -> dict[str, float]:
        """One step's phase floors (G replays; the prompt backward in the full mode), or ``{}`` where the floors do
        not model the family."""
        if not self.modelled:
            return {}
        floor = {
            "capture": self.capture(p),
            "generation": self.generation(r, state),
            "replay": g * self.replay(p, r, state),
        }
        if full:
            floor["prompt_backward"] = self.prompt_backward(p)
        return floor

    def as_dict(self) -> dict:
        return {
            "decoder_params": self.decoder,
            "head_params": self.head,
            "lora_params": self.lora,  # the trained parameters but the head (the whole decoder without LoRA)
            "attention_heads_x_head_dim_x_layers": self.attn_per_pair,  # the floors' Hq d x full-attention layers
            "head_trained": self.head_trained,
            "weight_bytes_read_per_decode_step": self.weight_bytes,
        }


# ----------------------------------------------------------------------------------------------------
# LongStraw: one GRPO step through LongStrawGRPOTrainer.train()
# ----------------------------------------------------------------------------------------------------
def _random_reward(completions, **kwargs):
    return [random.random() for _ in completions]


def random_letters(n: int, seed: int) -> str:
    """n lowercase letters: n tokens of the toy tokenizer (one per character, no special tokens added)."""
    return "".join(random.Random(seed).choices(string.ascii_lowercase, k=n))


def tokenizer_without_reachable_eos(vocab_size: int):
    """The toy tokenizer with one extra id as EOS: the model cannot sample it, so every response has R tokens."""
    tokenizer = build_toy_tokenizer(vocab_size + 1)
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(vocab_size)
    return tokenizer


class _KeepMetrics(TrainerCallback):
    """TRL's ``log`` clears ``_metrics`` right after the callbacks' ``on_log``: keep a copy there."""

    def __init__(self, metrics: dict):
        self.metrics, self.kept = metrics, defaultdict(list)

    def on_log(self, args, state, control, **kwargs):
        for k, v in self.metrics.items():
            self.kept[k].extend(v)


def record_progress(trainer, entry: dict, save) -> None:
    """After each capture and each generation call of ``trainer``, its phase seconds so far (and the peak) go into
    ``entry["partial"]`` and the JSON is written: a step cut by the command's timeout still leaves what finished."""
    metrics = trainer._metrics["train"]

    def recording(stock):
        def wrapped(*a, **k):
            out = stock(*a, **k)
            if isinstance(out, PromptState):  # where the capture's time went, chunk by chunk
                entry["capture_chunk_s"] = [round(x, 4) for x in out.chunk_seconds]
            entry["partial"] = {key: list(v) for key, v in metrics.items() if key.endswith("_seconds")}
            entry["partial"]["peak_gib_so_far"] = peak_gib() if torch.cuda.is_available() else None
            save()
            return out

        return wrapped

    trainer.prompt_states.capture = recording(trainer.prompt_states.capture)
    trainer._generate_single_turn = recording(trainer._generate_single_turn)
    # and after each prompt-backward segment: a step cut by the timeout keeps their seconds
    if PROBE is not None:
        PROBE.entry, PROBE.save = entry, save


class SegmentProbe:
    """Times each recomputed segment of the full mode's prompt backward (``engine.backward_segment``, which
    ``prompt_backward`` looks up at call time; synchronised) and profiles one of them: where the prompt backward's
    seconds go, segment by segment (later segments attend to more pages) and kernel family by family."""

    def __init__(self, profile_top: int):
        self.top = profile_top
        self.entry: dict | None = None  # the running step's JSON entry, and the function that writes it
        self.save: Callable[[], object] = lambda: None
        self.stock = longstraw_engine.backward_segment
        longstraw_engine.backward_segment = self._timed
        self.start_step(0)

    def start_step(self, segments: int) -> None:
        self.seconds: list[float] = []
        self.starts: list[int] = []  # each timed segment's first token (the segments run last to first)
        self.profile: dict | None = None
        self.profile_at = segments // 2 if self.top else None

    def _timed(self, model, state, grads, ids, start: int, *args, **kwargs):
        profiled = len(self.seconds) == self.profile_at
        prof = kernel_profiler(record_shapes=True) if profiled else contextlib.nullcontext()
        sync()
        began = time.perf_counter()
        with prof:
            out = self.stock(model, state, grads, ids, start, *args, **kwargs)
            sync()
        seconds = time.perf_counter() - began
        if profiled:
            families = kernel_families(prof)
            device_s = sum(f["self_s"] for f in families.values())
            self.profile = {
                "segment_index": len(self.seconds),
                "wall_s": seconds,
                "device_s": device_s,
                "device_busy_share": device_s / seconds,
                "families": families,
                "top_kernels": top_kernels(prof, self.top),
                "top_ops": top_ops(prof, self.top),  # the ops (and shapes) that launched them
            }
        self.seconds.append(seconds)
        self.starts.append(int(start))
        if self.entry is not None:
            self.entry.setdefault("partial", {}).update(self.result())
            self.save()
        return out

    def result(self) -> dict:
        return {
            "segment_s": [round(x, 4) for x in self.seconds],
            "segment_start_tokens": self.starts,
            "segment_profile": self.profile,
        }


PROBE: SegmentProbe | None = None


def longstraw_trainer(
    model, tokenizer, args, p: int, r: int, peft_config=None, gradient_mode: str = "response_only"
) -> LongStrawGRPOTrainer:
    out_dir = tempfile.mkdtemp(prefix="longstraw_full_")  # nothing is saved there (save_strategy="no")
    atexit.register(shutil.rmtree, out_dir, ignore_errors=True)
    memory = dict(offload_keep_layers_on_device=not args.stream_all_layers)
    if args.prompt_backward_checkpointing is not None:
        memory["prompt_backward_checkpoint_layers"] = args.prompt_backward_checkpointing
    for name, flag in MEMORY_FLAGS.items():  # with --library-defaults, the config's own ("auto") unless given
        if not args.library_defaults or flag in args.given:
            memory[name] = getattr(args, flag)
    if args.preflight_gpu_memory_gib is not None:
        memory["preflight_gpu_memory_bytes"] = int(args.preflight_gpu_memory_gib * 2**30)
    config = LongStrawGRPOConfig(
        output_dir=out_dir,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        max_steps=1,
        num_generations=args.generations,
        per_device_train_batch_size=args.generations,
        gradient_accumulation_steps=1,
        max_completion_length=r,
        page_size=args.page,
        graph_free_fused_kernels=args.fused_kernels,
        autograd_fused_kernels=args.autograd_fused_kernels,
        gradient_mode=gradient_mode,
        gradient_checkpointing=args.gradient_checkpointing,
        cp_size=args.cp_size,
        ep_size=args.ep_size,
        ep_implementation=args.ep_implementation,
        use_cpu=args.tiny,
        bf16=not args.tiny,
        **memory,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = LongStrawGRPOTrainer(
            model=model,
            reward_funcs=_random_reward,
            args=config,
            # one row per process: under `accelerate launch` every rank takes a group (a CP group: its first rank's)
            train_dataset=Dataset.from_dict({"prompt": [random_letters(p, seed=p)] * WORLD_SIZE}),
            processing_class=tokenizer,
            peft_config=peft_config,
        )
    trainer.remove_callback(PrinterCallback)
    assert min(trainer.eos_token_ids) >= trainer.model.config.vocab_size, trainer.eos_token_ids
    return trainer


def _device_memory_gib() -> float:
    """This card's memory, for the plan's ``fits`` (the planner's H200 figure in a CPU dry run)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GiB
    return GPU_MEMORY_GIB["h200"]


def _guarded(fn, *args):
    """``fn(*args)``, or an OOM / error record; the failed call's tensors are freed before returning."""
    failure = None
    MEMORY_MARKS.clear()
    try:
        return fn(*args)
    except torch.OutOfMemoryError as exc:
        failure = {
            "ok": False,
            "oom": True,
            "peak_gib_at_oom": peak_gib() if torch.cuda.is_available() else None,
            # where, and the allocator's own account (allocated / reserved but unallocated): what the peak was made of
            "oom_message": str(exc)[:600],
            "oom_where": [
                f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                for f in traceback.extract_tb(exc.__traceback__)
            ][-10:],
            **MEMORY_MARKS,
        }
    except Exception as exc:  # noqa: BLE001 - recorded, and the other measurements still run
        traceback.print_exc()
        failure = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    gc.collect()  # outside the except block: its traceback held the failed step's tensors
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return failure


def chosen_plan_options(trainer) -> dict:
    """The planner's options for the step ``trainer`` ran: its config's, with the pre-flight plan's choices for the
    settings left at "auto" (where the state lives, smaller chunks or replay batches)."""
    return {
        **plan_options(trainer.args),
        "offload_prompt_state": trainer.preflight.offload_prompt_state,
        **trainer.preflight.settings,
    }


def preflight_record(trainer) -> dict | None:
    """What the trainer's pre-flight plan decided at the step's first batch, as it logged it (None: no plan made)."""
    decision = trainer.preflight.decision
    if decision is None:
        return None
    return {
        "requested": decision.requested,
        "offload_prompt_state": decision.offload_prompt_state,
        "placement": decision.placement,
        "reason": decision.reason(),
        "settings": decision.settings,
        "device_state_bytes": decision.device_state_bytes,
        "planned_peak_gib": decision.plan.peak / 2**30,
        # "auto": both places with the preferred settings
        "resident_peak_gib": decision.resident.peak / 2**30 if decision.resident else None,
        "offloaded_peak_gib": decision.offloaded.peak / 2**30 if decision.offloaded else None,
    }


# allocated device memory at marks of the running step (_MemoryMarks), kept for an OOM record too
MEMORY_MARKS: dict[str, float] = {}


class _MemoryMarks(TrainerCallback):
    """Allocated device memory when train() begins, after Accelerate has prepared (e.g. FSDP2-wrapped) the model:
    the wrapped model's resting footprint, beside the step's peak."""

    def on_train_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            MEMORY_MARKS["allocated_at_train_begin_gib"] = allocated_gib()


def longstraw_step(trainer, floors: Floors, args, p: int, r: int, plan_dtype_bytes: int) -> dict:
    keep = _KeepMetrics(trainer._metrics["train"])
    trainer.add_callback(keep)
    trainer.add_callback(_MemoryMarks())
    trainer.model.zero_grad(set_to_none=True)
    reset_peak()
    if PROBE is not None:
        PROBE.start_step(-(-p // args.chunk))
    alloc_before = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    with Timer() as t:
        trainer.train()
    alloc_after = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    # cudaMalloc retries (the caching allocator freed its cache and synchronised to find room) and device
    # allocations during the step: an allocator near the memory limit shows here
    allocator = {
        k: alloc_after.get(k, 0) - alloc_before.get(k, 0)
        for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")
    }
    m = keep.kept
    peak = peak_gib() if torch.cuda.is_available() else None
    state_by_kind = {
        k.rsplit("/", 1)[1]: int(v[-1]) for k, v in m.items() if k.startswith("longstraw/state_bytes/")
    }
    state = sum(state_by_kind.values())
    g = args.generations
    full = trainer.args.gradient_mode.full
    names = (
        ("capture", "generation", "replay", "prompt_backward")
        if full
        else ("capture", "generation", "replay")
    )
    seconds = {k: sum(m[f"longstraw/{k}_seconds"]) for k in names}
    floor = floors.phases(p, r, g, state, full)
    phases = {
        k: {
            "seconds": seconds[k],
            "floor_s": floor.get(k),
            "over_floor": seconds[k] / floor[k] if floor else None,
        }
        for k in seconds
    }
    if full and floor:
        at_rates = floors.prompt_backward_at_kernel_rates(p)
        phases["prompt_backward"]["floor_at_kernel_rates_s"] = at_rates
        phases["prompt_backward"]["over_floor_at_kernel_rates"] = (
            seconds["prompt_backward"] / at_rates if at_rates else None
        )
    phases["replay"]["per_response_s"] = seconds["replay"] / g
    phases["replay"]["per_response_floor_s"] = floor["replay"] / g if floor else None
    logprob_s = sum(m.get("longstraw/logprob_replay_seconds", []))  # old-policy replays, if TRL asked for any
    phases["optimizer_and_other"] = {"seconds": t.seconds - sum(seconds.values()) - logprob_s}
    step_floor = sum(floor.values()) if floor else None
    # FSDP2 (docs/fsdp.md): over every process, or at world size 1 its gathered copies as overhead
    fsdp_size = trainer.parallel_dims.dp_shard if trainer.parallel_dims.fsdp else 0
    plan = plan_memory(
        floors.config,
        p,
        response_tokens=r,
        lora_rank=args.lora_rank or None,  # None: full fine-tuning
        gpu_memory_gib=_device_memory_gib(),
        page_size=args.page,
        dtype_bytes=plan_dtype_bytes,
        fsdp_size=fsdp_size,
        # the layers of an offloaded state the trainer's pre-flight plan kept on the device
        device_state_bytes=trainer.preflight.device_state_bytes,
        # the trainer's config (chunk, checkpointing, gradient mode, CP, EP) with what its pre-flight chose for "auto"
        **chosen_plan_options(trainer),
    )
    return {
        "ok": True,
        "gradient_mode": trainer.args.gradient_mode,
        "offload_prompt_state": trainer.preflight.offload_prompt_state,
        # the memory settings as configured ("auto": the pre-flight plan's to choose) and what it decided
        "configured": {name: getattr(trainer.args, name) for name in (*MEMORY_FLAGS, *OTHER_MEMORY_SETTINGS)},
        "preflight": preflight_record(trainer),
        "device_state_bytes": trainer.preflight.device_state_bytes,
        "gradient_checkpointing": trainer.args.gradient_checkpointing,
        "prompt_backward_checkpoint_layers": trainer.args.prompt_backward_checkpoint_layers,
        "prompt_tokens_captured": int(m["longstraw/prompt_tokens"][-1]),
        "response_tokens_min_max": [
            int(min(m["completions/min_length"])),
            int(max(m["completions/max_length"])),
        ],
        "train_s": t.seconds,
        "trainer_step_time_s": sum(m["step_time"]),  # training_step: generation + loss, no optimizer
        "step_floor_s": step_floor,
        "step_over_floor": t.seconds / step_floor if floor else None,
        "phases": phases,
        "logprob_replay_s": logprob_s,
        "state_bytes": state,
        "state_bytes_by_kind": state_by_kind,
        "peak_gib": peak,
        **MEMORY_MARKS,
        "trainer_peak_memory_gib": max(m["longstraw/peak_memory_gib"]),  # before the optimizer step
        "capture_peak_gib": max(m.get("longstraw/capture_peak_memory_gib", [float("nan")])),
        # full mode: the step's peak before its prompt backward (captures, generation, replays)
        "peak_before_prompt_backward_gib": max(
            m.get("longstraw/peak_before_prompt_backward_gib", [float("nan")])
        ),
        "planner": {
            "peak_gib": plan.peak / GiB,
            "capture_peak_gib": plan.capture_peak / GiB,
            "replay_peak_gib": plan.replay_peak / GiB,
            "fits": plan.fits,
            "fsdp_size": fsdp_size,
            "fsdp_gathered_gib": plan.fsdp_gathered / GiB,
        },
        "peak_over_planner": peak / (plan.peak / GiB) if peak is not None else None,
        # under a launch of several ranks each one's own (CP pages and EP experts differ by rank); rank 0's above
        "by_rank": _by_rank({"peak_gib": peak, "state_bytes": state, "train_s": t.seconds}),
        "expert_parallel": _expert_parallel(trainer),
        "allocator": allocator,
        **(PROBE.result() if PROBE is not None and full else {}),
    }


def _by_rank(mine: dict) -> list[dict] | None:
    """``mine`` from every rank of the launch (a collective: every rank calls it), or None in one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"rank": dist.get_rank(), **mine})
    return everyone


def _expert_parallel(trainer) -> dict | None:
    """The experts split over this rank's EP group: each sharded expert weight's experts here and in all."""
    ep = trainer.expert_parallel
    if ep is None:
        return None
    here = {int(p.to_local().shape[0]) for p in ep.parameters}
    return {
        "ep_size": ep.size,
        "implementation": trainer.args.ep_implementation,
        "sharded_weights": len(ep.parameters),
        "experts_here": sorted(here),
        "experts": sorted({int(p.shape[0]) for p in ep.parameters}),
    }


def estimate_longstraw(prev: dict, floors: Floors, args, p: int) -> float | None:
    """This P's step from the previous measured step: each phase's seconds over floor times this P's floor (None
    without floors: the step runs)."""
    state = floors.state_bytes(p, args.page)
    now = floors.phases(p, args.response, args.generations, state, full=False)
    if not now:
        return None
    return prev["phases"]["optimizer_and_other"]["seconds"] + sum(
        prev["phases"][k]["over_floor"] * now[k] for k in now
    )


def run_longstraw(policy, tokenizer, floors, args, results: list, save, deadline, dtype_bytes) -> None:
    prev = {}  # by gradient mode
    for p, mode in [(p, mode) for p in args.prompts for mode in args.gradient_modes]:
        left = deadline - time.perf_counter()
        # the full mode's prompt backward is not in the estimate: its first P always runs
        estimate = (
            estimate_longstraw(prev[mode], floors, args, p) if mode in prev and mode != "full" else None
        )
        if left <= 0 or (estimate is not None and estimate > left):
            results.append(
                {
                    "prompt_tokens": p,
                    "gradient_mode": mode,
                    "ok": False,
                    "skipped": "budget",
                    "estimate_s": estimate,
                    "left_s": left,
                }
            )
            save()
            continue
        results.append(
            {"prompt_tokens": p, "gradient_mode": mode, "status": "running", "estimate_s": estimate}
        )
        save()
        # a fresh trainer (and optimizer) per P, on the same PEFT model
        trainer = longstraw_trainer(policy, tokenizer, args, p, args.response, gradient_mode=mode)
        record_progress(trainer, results[-1], save)
        result = _guarded(longstraw_step, trainer, floors, args, p, args.response, dtype_bytes)
        del trainer
        gc.collect()
        chunks = {k: v for k, v in results[-1].items() if k == "capture_chunk_s"}  # (record_progress's)
        results[-1] = {"prompt_tokens": p, **result, "estimate_s": estimate, **chunks}
        save()
        if result.get("oom"):
            break  # a larger P needs more memory
        if result["ok"]:
            prev[mode] = result


# ----------------------------------------------------------------------------------------------------
# Stock TRL: one prompt + completion per step at growing P, until out of memory
# ----------------------------------------------------------------------------------------------------
def stock_sequence(stock, config, p: int, r: int, dev: str, deadline: float) -> dict:
    g = torch.Generator(device=dev).manual_seed(p)
    prompt = torch.randint(0, config.vocab_size, (p,), device=dev, generator=g)
    comps = torch.randint(0, config.vocab_size, (1, r), device=dev, generator=g)
    out = attempt(stock_step, stock, prompt, comps, torch.ones(1, device=dev), deadline, 1)
    return {k: None if v != v else v for k, v in out.items()}  # NaN peaks (CPU) as JSON null


def run_stock(policy, config, floors: Floors, args, section: dict, save, deadline: float, dev: str) -> None:
    ns = argparse.Namespace(groups=args.generations, response=args.response, chunk=args.chunk, page=args.page)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stock, ours = build_trainers(policy, ns, dev)
    del ours
    # warm-up twice at a small P (first calls, allocator); the second one anchors the first estimate
    warm_p = min(1024, min(args.stock_prompts))
    for _ in range(2):
        prev = stock_sequence(stock, config, warm_p, args.response, dev, deadline)
    section["warmup"] = {"prompt_tokens": warm_p, **prev}
    if not prev["ok"]:
        return
    prev_p = warm_p
    results = section["results"]
    for p in args.stock_prompts:
        left = deadline - time.perf_counter()
        # forward-floor ratio as the cost ratio (dense linear in P, attention quadratic)
        estimate = prev["step_s"] * floors.capture(p + args.response) / floors.capture(prev_p + args.response)
        if left <= 0 or (estimate > left and not args.stock_ignore_estimates):
            results.append(
                {"prompt_tokens": p, "ok": False, "skipped": "budget", "estimate_s": estimate, "left_s": left}
            )
            section["stopped_by"] = section["stopped_by"] or "budget"
            save()
            continue
        results.append({"prompt_tokens": p, "status": "running", "estimate_s": estimate})
        save()
        r = stock_sequence(stock, config, p, args.response, dev, deadline)
        results[-1] = {"prompt_tokens": p, **r, "estimate_s": estimate}
        if r["ok"]:
            section.update(
                largest_fitting_prompt=p,
                largest_fitting_step_s=r["step_s"],
                largest_fitting_peak_gib=r["peak_gib"],
            )
            prev, prev_p = r, p
        save()
        if r.get("oom"):
            section.update(first_oom_prompt=p, first_oom_peak_gib=r["peak_gib_at_oom"], stopped_by="oom")
            break


# ----------------------------------------------------------------------------------------------------
def _status(r: dict) -> str:
    return (
        "OOM"
        if r.get("oom")
        else "skipped"
        if r.get("skipped")
        else r.get("error", r.get("status", "ok"))[:40]
    )


def _gib(r: dict) -> str:
    x = r.get("peak_gib") or r.get("peak_gib_at_oom")
    return "" if x is None else f"{x:.1f}"


def _seconds(seconds: float, over_floor: float | None) -> str:
    return f"{seconds:.1f}" + ("" if over_floor is None else f" ({over_floor:.1f}x)")


def summary_rows(payload: dict) -> list[dict]:
    rows = []
    for r in payload["longstraw"]:
        ph, ok = r.get("phases", {}), r.get("ok")
        row = {
            "side": f"longstraw {r.get('gradient_mode', '')}",
            "P": r["prompt_tokens"],
            "status": _status(r),
        }
        row["seconds (x floor)"] = _seconds(r["train_s"], r["step_over_floor"]) if ok else ""
        for k in ("capture", "generation", "replay", "prompt_backward"):
            row[k] = _seconds(ph[k]["seconds"], ph[k]["over_floor"]) if ok and k in ph else ""
        row["peak GiB"], row["planner GiB"] = _gib(r), f"{r['planner']['peak_gib']:.1f}" if ok else ""
        rows.append(row)
    for r in payload["stock"]["results"]:
        row = {"side": "stock, 1 seq", "P": r["prompt_tokens"], "status": _status(r)}
        row["seconds (x floor)"] = f"{r['step_s']:.1f}" if "step_s" in r else ""
        rows.append({**row, "peak GiB": _gib(r)})
    return rows


def main() -> None:
    global PROBE
    args = parse_args()
    if "full" in args.gradient_modes:
        PROBE = SegmentProbe(args.profile_segment)
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:  # under `accelerate launch`: this rank's GPU
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    start = time.perf_counter()
    deadline = start + args.budget_s
    dev, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    dtype_bytes = torch.finfo(dtype).bits // 8
    torch.manual_seed(0)
    random.seed(0)
    longest = max([*args.prompts, *args.stock_prompts, args.warmup_prompt])
    if args.preset == "glm-5":  # glm_slice.py's slice: layer 0 dense, the rest MoE, every indexer its own
        config = glm_slice_config(
            args.layers, ["full"] * args.layers, longest + args.response + 16, args.tiny
        )
        config.eos_token_id = None  # its default EOS id would be sampled: every response must have R tokens
    else:
        config = slice_config(
            args.preset, args.layers or (4 if args.tiny else None), longest + args.response + 16, args.tiny
        )
    name = f"full_model_{args.preset}{'_tiny' if args.tiny else ''}{args.tag}"

    rates = measure_rates(config, args.chunk, dev, dtype, args.page)  # on an empty device, before the weights
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    with Timer() as t_build:
        model = build_model(config, dev, dtype)
    tokenizer = tokenizer_without_reachable_eos(config.vocab_size)
    lora = (
        LoraConfig(
            r=args.lora_rank,
            lora_alpha=2 * args.lora_rank,
            target_modules=lora_targets(model),
            task_type="CAUSAL_LM",
        )
        if args.lora_rank
        else None  # full fine-tuning
    )
    # the first trainer wraps the model with the LoRA adapters; later trainers (and stock) share its PEFT model
    # the warm-up runs in the last mode asked for: with "full", its prompt backward compiles what the full steps run
    trainer = longstraw_trainer(
        model,
        tokenizer,
        args,
        args.warmup_prompt or min(args.prompts),  # without a warm-up this trainer only wraps the model
        args.warmup_response,
        peft_config=lora,
        gradient_mode=args.gradient_modes[-1],
    )
    policy = trainer.accelerator.unwrap_model(trainer.model)
    del model
    floors = Floors(policy, config, rates, dtype_bytes)

    payload = {
        "preset": args.preset,
        "layers": config.num_hidden_layers,
        "full_attention_layers": full_attention_layers(config),
        "model": f"{args.preset}, {config.num_hidden_layers} layers, random init (initializer_range "
        f"{config.initializer_range}), {str(dtype).removeprefix('torch.')}, "
        + (
            f"LoRA r={args.lora_rank} alpha={2 * args.lora_rank} {lora_description(lora)}"
            if args.lora_rank
            else "full fine-tuning"
        ),
        "generations": args.generations,
        "response_tokens": args.response,
        "capture_chunk_size": args.chunk,
        "page_size": args.page,
        "graph_free_fused_kernels": args.fused_kernels,
        "autograd_fused_kernels": args.autograd_fused_kernels,
        # the kernel switches set for this run (docs/guide.md, "Kernel switches"); unset: every fast path on
        "kernel_switches": {
            k: v for k, v in os.environ.items() if k.startswith("LONGSTRAW_") and k != "LONGSTRAW_REV"
        },
        "budget_s": args.budget_s,
        "fla_importable": importlib.util.find_spec("fla") is not None,  # GDN kernels of both sides
        "build_s": t_build.seconds,
        "weights_finite": True,
        "params": floors.as_dict(),
        "rates": rates,
        "floors": {
            "capture": "2 (decoder + LoRA params) P / GEMM + 2 P^2 Hq d x full-attention layers / attention",
            "generation": "R (bytes of all weights but the input embedding + state bytes) / copy bandwidth",
            "replay_per_response": "max((4 (decoder + head) + 6 LoRA params) R / GEMM + 10 Hq d R P x "
            "full-attention layers / attention, (3 weight bytes + 2 state bytes) / copy bandwidth)",
            "prompt_backward": "(4 decoder + 6 LoRA params) P / GEMM + 6 P^2 Hq d x full-attention layers / attention "
            "(recompute 2, dQ dK dV 4; causal)",
            "prompt_backward_at_kernel_rates": "the same FLOPs, dQ dK dV's 4 P^2 Hq d at the measured page-backward "
            "rate (rates.attention_backward_tflops)",
        },
        "longstraw_description": "LongStrawGRPOTrainer.train(), max_steps=1, a fresh trainer per P on one PEFT "
        "model: capture + generation (no reachable EOS: R tokens each) + G replays with backward + AdamW step",
        "longstraw_warmup": None,
        "longstraw": [],
        "stock": {
            "description": "trl.GRPOTrainer defaults (activation checkpointing on), same PEFT model, one "
            "prompt+completion per step: compute_loss + backward (compare_stock.stock_step), no generation, "
            "no optimizer step",
            "results": [],
            "largest_fitting_prompt": None,
            "first_oom_prompt": None,
            "stopped_by": None,  # "oom", or "budget" (a larger P skipped for time), or None: all ran
        },
    }
    # under `accelerate launch` the first rank writes the JSON (every rank runs the same steps)
    save = (lambda: write_result(name, payload)) if RANK == 0 else (lambda: None)  # noqa: E731

    if args.skip_longstraw:
        payload["longstraw"] = [
            {"prompt_tokens": p, "ok": False, "skipped": "--skip-longstraw"} for p in args.prompts
        ]
    else:
        if args.warmup_prompt:
            payload["longstraw_warmup"] = {
                "prompt_tokens": args.warmup_prompt,
                "response_tokens": args.warmup_response,
            }
            warm = _guarded(
                longstraw_step, trainer, floors, args, args.warmup_prompt, args.warmup_response, dtype_bytes
            )
            payload["longstraw_warmup"].update(warm)
            save()
        # the warm-up trainer's optimizer state, gradients and cached prompt state must not sit under the measured
        # steps' peaks (each measured P gets a fresh trainer): about 4 GiB at r = 64
        trainer.free_prompt_states()
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        trainer = None
        run_longstraw(policy, tokenizer, floors, args, payload["longstraw"], save, deadline, dtype_bytes)
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    if args.skip_stock:
        payload["stock"]["results"] = [
            {"prompt_tokens": p, "ok": False, "skipped": "--skip-stock"} for p in args.stock_prompts
        ]
    else:
        failure = _guarded(run_stock, policy, config, floors, args, payload["stock"], save, deadline, dev)
        if failure:
            payload["stock"].update(failure)
    payload["total_s"] = time.perf_counter() - start
    path = save()

    r = rates
    print(
        f"{payload['model']}; G={args.generations}, R={args.response}; GEMM {r['matmul_tflops']:.0f} TFLOP/s, "
        f"attention {r['attention_tflops']:.0f} TFLOP/s, copy {r['copy_gbs']:.0f} GB/s; built in {t_build.seconds:.0f} s"
    )
    print_table(summary_rows(payload))
    print(f"wrote {path} ({payload['total_s']:.0f} s)")
    failed = [
        x
        for x in [payload["longstraw_warmup"] or {}, *payload["longstraw"], payload["stock"]]
        if "error" in x
    ]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
