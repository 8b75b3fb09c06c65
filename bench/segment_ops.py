"""Which aten ops one recomputed prompt segment of the full gradient runs, and where they come from (CPU).

The full mode's prompt backward (``prompt_backward``: each capture chunk recomputed under autograd, then its
backward) launched about 260 copy and 220 elementwise kernels per layer per 16K-token segment on an H200
(``bench/results/full_model_qwen3.6-27b_h200_P131072_segment-profile.json``). Their number does not depend on the segment's
length, so a tiny Qwen3.5 hybrid on the CPU runs the same Python and shows the same ops: this script captures a
prompt of a few chunks (``keep_boundaries=True``), replays responses with the full gradient, then profiles
``prompt_backward`` and counts the kernel-launching aten ops (those with no aten op below them but allocations
and views) per family (copy, cast, cat, fill, elementwise, reduction, gemm, attention, other), per layer per
segment, and by source: the innermost frame in LongStraw's code (``longstraw_trl/``, ``kernels/``,
``model_patches/``), else transformers' / peft's, else torch's; an op run by autograd's backward is attributed
to the forward op that recorded the node (``autograd <Node> <- <forward source>``).

``--dtype bf16``: bf16 weights, PEFT's fp32 adapters and bf16 autocast (what the trainer runs on the GPU; CPU
autocast's op lists differ from CUDA's, so the cast counts are indicative). The GDN rule on the CPU is the torch
chunked rule (one loop step per 64 tokens; fla's kernels on the GPU), so its rows say nothing about the GPU.

    python bench/segment_ops.py                     # fp32 and bf16, LoRA, layer checkpointing (the trainer's)
    python bench/segment_ops.py --dtype bf16 --top 40 --no-lora
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import re
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

from longstraw_trl import capture_prompt, replay_logprobs
from longstraw_trl.adapters import bind_autocast_lora_inputs
from longstraw_trl.engine import StateGrads, prompt_backward

OURS = ("longstraw_trl/", "kernels/", "model_patches/")
HF = ("transformers/", "peft/")
# ops that launch no kernel (allocations, views, metadata): ignored when deciding whether an op is a leaf
FREE = re.compile(
    r"aten::(empty|empty_strided|empty_like|view|_unsafe_view|as_strided|_reshape_alias|reshape|expand|"
    r"transpose|t|permute|unsqueeze|squeeze|select|slice|narrow|split|split_with_sizes|unbind|chunk|alias|"
    r"detach|detach_|lift_fresh|resize_|set_|unflatten|flatten|view_as|expand_as|result_type|is_nonzero|"
    r"item|_local_scalar_dense|movedim|diagonal|_has_compatible_shallow_copy_type|resolve_conj|resolve_neg|conj|"
    r"mH|mT|to|as_strided_|new_empty|new_empty_strided|_to_copy)$"
)
PY_FRAME = re.compile(r"^(.+)\((\d+)\): (.+)$")
FAMILIES = {
    "copy": r"aten::(copy_|clone|contiguous)$",
    "cat": r"aten::(cat|stack|_cat|index_select|repeat_interleave|index|index_put_|constant_pad_nd|masked_scatter)$",
    "fill": r"aten::(fill_|zero_|zeros|ones|full|new_zeros|new_full|ones_like|zeros_like|arange|triu|tril)$",
    "gemm": r"aten::(mm|bmm|addmm|baddbmm|addmm_|matmul|linear|_convolution|convolution|conv1d|linalg_solve_triangular"
    r"|convolution_backward|_slow_conv2d_forward|_linalg_solve_triangular|einsum)$",
    "attention": r"aten::_scaled_dot_product.*",
    "reduction": r"aten::(sum|mean|amax|amin|max|min|logsumexp|norm|linalg_vector_norm|cumsum|all|any|var)$",
}


def family(name: str, dtype_cast: bool) -> str:
    if name == "aten::copy_" and dtype_cast:
        return "cast"
    for fam, pattern in FAMILIES.items():
        if re.match(pattern, name):
            return fam
    if name.startswith("aten::"):
        return "elementwise"  # add, mul, pow, exp, silu, where, ... (and the rare other op)
    return "other"


KINDS = {"G": "linear_attention", "F": "full_attention"}


def _tiny_model(pattern: str, seed: int = 0) -> torch.nn.Module:
    """A Qwen3.5 hybrid of tiny dimensions whose layers follow ``pattern`` (``G``: Gated DeltaNet, ``F``: gated full
    attention; Qwen3.6-27B is ``GGGF`` 16 times)."""
    torch.manual_seed(seed)
    kinds = [KINDS[c] for c in pattern]
    layers = len(kinds)
    config = Qwen3_5TextConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        layer_types=kinds,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        rope_parameters=dict(
            rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25, mrope_section=[2, 1, 1]
        ),
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()


def _with_lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj"]
    targets += ["gate_proj", "up_proj", "down_proj"]
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(model, cfg)


def _source(frames: list[str]) -> str:
    """The innermost frame in LongStraw's code or in transformers / peft, else the innermost frame."""
    for frame in frames:
        if _in(frame, (*OURS, *HF)):
            return _short(frame)
    return _short(frames[0]) if frames else "?"


def _short(frame: str) -> str:
    # "path/to/file.py(123): func" -> "file-relative path:123 func"
    m = re.match(r"(.*)\((\d+)\): (.*)", frame)
    if not m:
        return frame
    path, line, func = m.groups()
    for marker in (*OURS, "transformers/", "peft/", "torch/"):
        at = path.replace("\\", "/").rfind(marker)
        if at >= 0:
            path = path.replace("\\", "/")[at:]
            break
    return f"{path}:{line} {func}"


def _frames(e, stop=None) -> list[str]:
    """The Python frames above profiler event ``e`` (up to ``stop``), innermost first (``with_stack`` records them
    as events)."""
    frames = []
    p = e.cpu_parent
    while p is not None and p is not stop:
        if PY_FRAME.match(p.name) and "segment_ops.py" not in p.name:
            frames.append(p.name)
        p = p.cpu_parent
    return frames


def count_ops(prof) -> tuple[collections.Counter, collections.Counter, collections.Counter]:
    """(ops by family, ops by (family, source), ops by (family, op name)) over the profile's kernel-launching ops."""
    events = [e for e in prof.events() if e.device_type.name == "CPU"]

    def is_leaf(e) -> bool:
        stack = list(e.cpu_children)
        while stack:
            c = stack.pop()
            if c.name.startswith("aten::") and not FREE.match(c.name):
                return False
            stack.extend(c.cpu_children)
        return True

    # the Python frames of the forward op that recorded each autograd node (its sequence number)
    fwd_frames: dict[int, list[str]] = {}
    for e in events:
        if e.sequence_nr >= 0 and e.name.startswith("aten::") and e.sequence_nr not in fwd_frames:
            frames = _frames(e)
            if frames and not any("autograd::engine" in f for f in frames):
                fwd_frames[e.sequence_nr] = frames

    by_family, by_source, by_name = collections.Counter(), collections.Counter(), collections.Counter()
    for e in events:
        if not e.name.startswith("aten::") or FREE.match(e.name) or not is_leaf(e):
            continue
        cast = e.name == "aten::copy_" and len(e.input_dtypes) >= 2 and e.input_dtypes[0] != e.input_dtypes[1]
        fam = family(e.name, cast)
        # the autograd node running the op, if it runs in backward, and the Python frames above it
        node, p = None, e.cpu_parent
        while p is not None and node is None:
            if p.name.startswith("autograd::engine::evaluate_function: "):
                node = p
            p = p.cpu_parent
        # Python code between the op and its node (our autograd.Function's backward, a checkpoint's recompute)
        inner = _frames(e, stop=node) if node is not None else []
        frames = _frames(e)
        if node is not None and not any(_in(f, (*OURS, *HF)) for f in inner):
            origin = fwd_frames.get(node.sequence_nr, [])
            label = node.name.removeprefix("autograd::engine::evaluate_function: ")
            src = f"autograd {label} <- {_source(origin) if origin else '?'}"
        else:
            src = _source(inner or frames)
        by_family[fam] += 1
        by_source[(fam, f"{src}  {e.name.removeprefix('aten::')}")] += 1
        by_name[(fam, e.name + (" (cast)" if cast else ""))] += 1
    return by_family, by_source, by_name


def _in(frame: str, groups: tuple[str, ...]) -> bool:
    path = "/" + frame.replace("\\", "/")  # the profiler names site-packages frames from the package down
    return any(f"/{g}" in path for g in groups)


def run(args, dtype: str) -> dict:
    model = _tiny_model(args.layers)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    if args.lora:
        model = _with_lora(model)  # PEFT keeps the adapters in fp32 beside a bf16 model, as on the GPU
        bind_autocast_lora_inputs(model)  # the trainer binds it
    model.train(False)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 97, (args.segments * args.chunk + 1,), generator=gen)
    comps = torch.randint(0, 97, (2, 8), generator=gen)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()
    state = capture_prompt(model, prompt, chunk_size=args.chunk, page_size=args.page, keep_boundaries=True)
    grads = StateGrads(state)
    with autocast:
        logp = replay_logprobs(
            state, model, comps, grad=True, grads=grads, checkpoint_layers=args.checkpoint_layers
        )
        logp.sum().backward()
        acts = [ProfilerActivity.CPU]
        with profile(activities=acts, record_shapes=True, with_stack=True) as prof:
            prompt_backward(state, model, grads, checkpoint_layers=args.checkpoint_layers)
    by_family, by_source, by_name = count_ops(prof)
    return {"family": by_family, "source": by_source, "name": by_name}


def print_table(title: str, result: dict, per: float, top: int) -> None:
    print(f"\n=== {title}: ops per layer per segment (total / {per:g}) ===")
    total = sum(result["family"].values())
    for fam, n in sorted(result["family"].items(), key=lambda x: -x[1]):
        print(f"  {fam:<12} {n / per:8.1f}")
    print(f"  {'all':<12} {total / per:8.1f}")
    for key, what in (("name", "op"), ("source", "source")):
        print(f"\n  top {top} by {what} (copy, cast, cat, fill and elementwise):")
        rows = [
            (k, n) for k, n in result[key].items() if k[0] in ("copy", "cast", "cat", "fill", "elementwise")
        ]
        for (fam, where), n in sorted(rows, key=lambda x: -x[1])[:top]:
            print(f"  {n / per:8.2f}  {fam:<11} {where}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    ap.add_argument(
        "--layers",
        default="GGGF",
        type=lambda x: x if x and set(x) <= set(KINDS) else ap.error(f"--layers takes G and F, got {x!r}"),
        help="the decoder layers, G: Gated DeltaNet, F: full attention (default GGGF, Qwen3.6-27B's ratio); "
        "F or G alone gives one kind's ops per layer",
    )
    ap.add_argument("--segments", type=int, default=3, help="capture chunks of the prompt (segments)")
    ap.add_argument("--chunk", type=int, default=64, help="tokens per capture chunk")
    ap.add_argument("--page", type=int, default=64, help="tokens per K/V page")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--no-lora", dest="lora", action="store_false", help="no LoRA adapters (full fine-tuning)"
    )
    ap.add_argument(
        "--no-checkpoint-layers",
        dest="checkpoint_layers",
        action="store_false",
        help="keep each layer's activations (the trainer checkpoints them: TRL's gradient_checkpointing)",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]))
    print(
        f"layers {args.layers}, {args.segments} segments of {args.chunk} tokens, LoRA {args.lora}, "
        f"checkpoint_layers {args.checkpoint_layers}"
    )
    for dtype in args.dtype:
        result = run(args, dtype)
        print_table(f"{dtype}, layers {args.layers}", result, len(args.layers) * args.segments, args.top)


if __name__ == "__main__":
    main()
