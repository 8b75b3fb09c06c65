"""GLM-5 (``glm_moe_dsa``) on a real-dimension slice: capture P tokens, generate G responses, replay them with
backward, with the prompt state on the GPU and offloaded to pinned host memory.

The slice (preset ``glm-5``: hidden 6144, 64 heads, MLA q_lora 2048 / kv_lora 512 / rope 64 / nope 192 /
v 256, DSA indexer 32 x 128 with top-2048, 256 experts top-8 + 1 shared, vocab 154880) keeps 3 layers by
default: layer 0 dense, layers 1-2 MoE; indexer types ``full, shared, shared`` (IndexShare: the shared layers
reuse layer 0's top-k; GLM-5's released config has every layer full, so the slice sets them). Random bf16
weights. Trained: every parameter but the routed experts (their 2 x 19 GB of gradients would not leave room
for a 2M-token state; their activations still get gradients, so backward runs through the MoE blocks).

Per (P, storage): peaks, state bytes on the GPU and in host memory, capture / generation / replay seconds
against floors from rates measured in the same run (bf16 GEMM, device copy, host-to-device copy, and the
indexer: its fused score kernel's TFLOP/s and the whole top-k flow's ns per score, at a capture chunk's
shape, printed on the first line):
- capture: indexer scores (2 x 32 x 128 FLOPs per q-k pair the capture scores: causal pairs plus the masked
  half of each chunk's own, each full layer) at the indexer kernel's rate, plus writing and reading each
  score once at the copy rate (its top-k), sparse attention in latent space (2 x 64 x (576 + 512) per query
  and selected key, each layer) and dense (2 per active parameter per token) FLOPs at the GEMM rate;
- generation: bytes per decode step (the non-expert weights, the experts G x top-8 rows can reach, the indexer
  keys of the full layers, the selected latent rows) at the device copy rate; for offloaded state the larger
  of the device's reads (the same less the selected rows: a decode call copies the indexer keys to the device
  once, before its first step) and the selected latent rows at the host-to-device rate (they can overlap);
- replay: the larger of its FLOPs (indexer over the prompt at the indexer rate, attention forward + backward,
  dense 6 per active parameter per token) and its bytes.
Offloaded generation decodes ``--offload-gen-tokens`` tokens (default 256) and reports seconds per token too.
Runs are ordered (1M resident, 1M offloaded, 2M resident, 2M offloaded) and one whose estimated time does not
fit what is left of ``--budget-s`` is skipped and listed as such. The estimate: the indexer's top-k flow at
its measured ns per score, and every other part at its floor times the ratio measured/floor of the last case
run (of the same storage if any; 1 before the first). The JSON is written after every phase, and each case's
row is printed when it ends (a run cut short keeps what it measured).

    python bench/glm_slice.py --prompt 1048576 2097152 --budget-s 540
    python bench/glm_slice.py --smoke      # CPU dry run, tiny widths
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from common import (
    GiB,
    Timer,
    allocated_gib,
    copy_bandwidth_gbs,
    matmul_tflops,
    mean_after_first,
    peak_gib,
    reset_peak,
    write_result,
)
from transformers import AutoModelForCausalLM

import longstraw_trl.kernels.sparse_attention.dsa as sparse
from longstraw_trl import capture_prompt, generate_from_state, replay_logprobs
from longstraw_trl.generation import decode_graphs_by_default
from longstraw_trl.host_memory import registered_host_bytes, streamed_bytes
from longstraw_trl.kernels.sparse_attention.dsa import TOPK_BUFFER_ELEMENTS, indexer_topk
from longstraw_trl.kernels.sparse_attention.indexer import index_scores, index_scores_kernel_available
from longstraw_trl.presets import preset_config


def pinned_host_bytes() -> int | None:
    """Bytes of pinned blocks the caching host allocator owns now (``None`` without CUDA or the statistic)."""
    if not torch.cuda.is_available():
        return None
    try:
        return int(torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0))
    except (AttributeError, RuntimeError):
        return None


def slice_config(layers: int, indexer_types: list[str], max_positions: int, smoke: bool):
    dense = 1
    if smoke:  # same layer pattern, tiny widths
        return preset_config(
            "glm-5",
            layers,
            vocab_size=512,
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=8,
            num_experts_per_tok=2,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            index_n_heads=4,
            index_head_dim=16,
            index_topk=64,
            first_k_dense_replace=dense,
            indexer_types=indexer_types,
            max_position_embeddings=max_positions,
        )
    return preset_config(
        "glm-5",
        layers,
        first_k_dense_replace=dense,
        indexer_types=indexer_types,
        max_position_embeddings=max_positions,
    )


def h2d_bandwidth_gbs(nbytes: int = GiB) -> float:
    """Measured pinned host-to-device copy rate, in GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    with Timer() as t:
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
    return 5 * nbytes / t.seconds / 1e9


def check_small(model, config, dev: str) -> dict[str, float]:
    """bf16 log-probs against the stock model's own forward at a small size, twice: with every indexer keeping all
    keys (``index_topk`` >= the length: bf16 rounding alone) and with the config's ``index_topk`` (the selection
    too: near-ties at the k-th score may fall either way in bf16). Max and mean of ``|dlogp|``."""
    g = torch.Generator(device=dev).manual_seed(0)
    n = 4096 if dev == "cuda" else 160
    prompt = torch.randint(0, config.vocab_size, (n,), device=dev, generator=g)
    comp = torch.randint(0, config.vocab_size, (2, n // 16), device=dev, generator=g)
    indexers = [m for m in model.modules() if hasattr(m, "index_topk")]
    kept = [m.index_topk for m in indexers]
    out = {}
    for name, topk in (("all_keys", n + n // 16), ("index_topk", None)):
        for m, k in zip(indexers, kept, strict=True):
            m.index_topk = k if topk is None else topk
        state = capture_prompt(model, prompt, chunk_size=n // 4, page_size=n // 4 + 64)
        got = replay_logprobs(state, model, comp)
        with torch.no_grad():
            full = torch.cat([prompt[None].expand(2, -1), comp], 1)
            logits = model(full, use_cache=False).logits[:, n - 1 : -1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, comp[..., None])[..., 0]
        diff = (got - ref).abs()
        out[f"{name}_max"], out[f"{name}_mean"] = diff.max().item(), diff.mean().item()
    for m, k in zip(indexers, kept, strict=True):
        m.index_topk = k
    return out


def param_counts(model, config) -> dict[str, int]:
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    embed = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())
    moe_layers = config.mlp_layer_types.count("sparse")
    per_expert = experts // max(1, moe_layers * config.n_routed_experts)
    active = total - embed - experts + moe_layers * config.num_experts_per_tok * per_expert
    return dict(
        total=total, experts=experts, embed=embed, head=head, active_per_token=active, per_expert=per_expert
    )


def indexer_probe(config, dev: str, smoke: bool) -> dict:
    """The indexer at a capture chunk's shape (one 4096-query block against four top-k buffers of prompt keys,
    as :func:`indexer_topk` lays them out): the score kernel alone, warm (TFLOP/s at 2 x heads x head_dim FLOPs
    per score), and the whole top-k flow (scores, buffer copies, merges; ns per score)."""
    hi, di, k = config.index_n_heads, config.index_head_dim, config.index_topk
    tq = 64 if smoke else 4096
    per_buffer = max(1, TOPK_BUFFER_ELEMENTS // tq) if not smoke else 512
    n = 4 * per_buffer
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, tq, hi, di, device=dev, generator=g).to(torch.bfloat16)
    w = torch.randn(1, tq, hi, device=dev, generator=g) * hi**-0.5
    keys = torch.randn(1, n, di, device=dev, generator=g).to(torch.bfloat16)
    buf = torch.empty(1, tq, k + per_buffer, device=dev)
    scale = di**-0.5

    def scores():
        index_scores(q, w, keys[:, :per_buffer], scale, out=buf[..., k:])

    scores()  # compile and autotune
    with Timer() as t:
        for _ in range(5):
            scores()
    kernel_tflops = 2 * hi * di * tq * per_buffer * 5 / t.seconds / 1e12
    pos = torch.arange(n, device=dev)
    # the whole flow at the default top-k buffer size and at others (fewer, wider merges or more, narrower
    # ones), and a top-k of one buffer alone: where the flow's time goes, and which size the next run should take
    by_buffer, topk_alone = {}, {}
    sizes = (1 << 26, 1 << 27, 1 << 28, 1 << 29) if not smoke else (1 << 14, 1 << 15)
    for elements in sorted({tq * per_buffer, *sizes}):  # (tq * per_buffer: the default, 2^27, off the smoke)
        width = elements // tq
        with torch.no_grad():
            sparse.TOPK_BUFFER_ELEMENTS, default = elements, sparse.TOPK_BUFFER_ELEMENTS
            try:
                indexer_topk(q, w, keys, pos, None, scale, k)
                with Timer() as t:
                    indexer_topk(q, w, keys, pos, None, scale, k)
            finally:
                sparse.TOPK_BUFFER_ELEMENTS = default
            wide = torch.randn(1, tq, k + width, device=dev, generator=g)
            wide.topk(k, dim=-1, sorted=False)
            with Timer() as t_topk:
                wide.topk(k, dim=-1, sorted=False)
            del wide
        by_buffer[elements] = t.seconds / (tq * n) * 1e9
        topk_alone[elements] = t_topk.seconds / (tq * (k + width)) * 1e9
    return {
        "indexer_kernel": index_scores_kernel_available(q, keys),
        "indexer_tflops": kernel_tflops,
        "indexer_topk_ns_per_score": by_buffer[tq * per_buffer],  # at the default buffer size
        "indexer_topk_buffer_elements": TOPK_BUFFER_ELEMENTS,
        "indexer_topk_ns_per_score_by_buffer_elements": by_buffer,
        "topk_alone_ns_per_element_by_buffer_elements": topk_alone,
    }


def scored_pairs(p: int, chunk: int) -> float:
    """q-k pairs the capture's indexer scores: every earlier chunk's keys, and all of its own chunk's (half of
    them masked)."""
    full, rest = divmod(p, chunk)
    sizes = [chunk] * full + ([rest] if rest else [])
    done = pairs = 0
    for c in sizes:
        pairs += c * done + c * c
        done += c
    return float(pairs)


def floors(config, counts, p: int, args, rates: dict, offload: bool) -> dict[str, float]:
    """Seconds each phase cannot go below at the measured rates: ``capture`` (of which ``capture_indexer``: the
    scores at the indexer kernel's rate, and each written and read once), ``gen_step``, ``replay``."""
    g, r = args.groups, args.response
    gemm, index_rate = rates["matmul_tflops"] * 1e12, rates["indexer_tflops"] * 1e12
    copy, h2d = rates["copy_gbs"] * 1e9, rates["h2d_gbs"] * 1e9
    n_full = config.indexer_types.count("full")
    layers = config.num_hidden_layers
    hi, di, k = config.index_n_heads, config.index_head_dim, config.index_topk
    h, d_lat = config.num_attention_heads, config.kv_lora_rank + config.qk_rope_head_dim
    attn_per_key = 2 * h * (d_lat + config.kv_lora_rank)
    scores = scored_pairs(p, args.chunk) * n_full
    capture_indexer = 2 * hi * di * scores / index_rate + 8 * scores / copy
    sel = k * (k + 1) / 2 + k * (p - k) if p > k else p * (p + 1) / 2  # sum over queries of min(k, visible)
    capture_other = (
        attn_per_key * sel * layers / gemm + 2 * (counts["active_per_token"] - counts["head"]) * p / gemm
    )
    moe_layers = config.mlp_layer_types.count("sparse")
    reach = min(config.n_routed_experts, g * config.num_experts_per_tok)
    step_weights = (counts["total"] - counts["experts"] - counts["embed"]) * 2 + moe_layers * reach * counts[
        "per_expert"
    ] * 2
    index_keys = n_full * p * di * 2
    latent_rows = layers * g * min(k, p) * d_lat * 2
    # offloaded: a decode call copies the indexer keys once (before its first step, outside the marginal per-token
    # figure) and each step reads the chosen latent rows over PCIe, which can overlap the device's reads
    if offload:
        gen_step = max((step_weights + index_keys) / copy, latent_rows / h2d)
    else:
        gen_step = (step_weights + index_keys + latent_rows) / copy
    rep_flops = (
        2 * hi * di * r * p * n_full / index_rate
        + 3 * attn_per_key * r * min(k, p) * layers / gemm
        + 6 * counts["active_per_token"] * r / gemm
    )
    state_bytes = layers * p * d_lat * 2 + index_keys
    rep_bytes = 2 * state_bytes / (h2d if offload else copy) + 3 * step_weights / copy
    return dict(
        capture=capture_indexer + capture_other,
        capture_indexer=capture_indexer,
        capture_other=capture_other,
        indexer_scores=scores,
        gen_step=gen_step,
        replay=max(rep_flops, rep_bytes),
    )


def run_case(
    model,
    config,
    counts,
    args,
    p: int,
    offload: bool,
    dev: str,
    rates: dict,
    result: dict,
    save,
    gen_tokens: int | None = None,
    replays: int | None = None,
) -> None:
    """Fill ``result`` phase by phase (``save()`` after each: a run cut short keeps what it measured).
    ``gen_tokens`` / ``replays``: fewer than the arguments say (the warm-up)."""
    model.zero_grad(set_to_none=True)
    storage = "cpu" if offload else None
    prompt = torch.randint(0, config.vocab_size, (p,), device=dev)
    reset_peak()
    streamed = streamed_bytes()
    with Timer() as t_cap:
        state = capture_prompt(
            model,
            prompt,
            chunk_size=args.chunk,
            page_size=args.page,
            offload_prompt_state=storage,
            progress=False,
        )
    cap_peak = peak_gib()
    cap_streamed, streamed = streamed_bytes() - streamed, streamed_bytes()
    fl = floors(config, counts, p, args, rates, offload)
    nbytes = state.nbytes()
    result.update(
        {
            "prompt_tokens": p,
            "storage": "host (pinned), streamed per layer" if offload else "gpu",
            "state_bytes_by_kind": state.nbytes_by_kind(),
            "state_bytes_gpu": 0 if offload else nbytes,
            "state_bytes_host": nbytes if offload else 0,
            "capture_s": t_cap.seconds,
            "capture_floor_s": fl["capture"],
            "capture_indexer_floor_s": fl["capture_indexer"],
            "capture_other_floor_s": fl["capture_other"],
            "capture_indexer_scores": fl["indexer_scores"],
            "capture_over_floor": t_cap.seconds / fl["capture"],
            "capture_peak_gib": cap_peak,
            "h2d_bytes_capture": cap_streamed,  # offloaded state streamed back (earlier chunks' pages)
            "capture_chunk_s": [round(x, 4) for x in state.chunk_seconds],  # grows with the indexer's prefix
            # pinned bytes PyTorch's caching host allocator holds (it rounds each block up to a power of two), and
            # the bytes the state's segments registered themselves (exact: longstraw_trl.host_memory.pinned_empty)
            "pinned_host_bytes": pinned_host_bytes(),
            "registered_host_bytes": registered_host_bytes(),
        }
    )
    save()
    gen_tokens = gen_tokens or (args.offload_gen_tokens if offload else args.gen_tokens)
    graphed = decode_graphs_by_default(state)  # what generate() does with each decode step
    reset_peak()
    # a call of half the tokens first: the difference of the two calls is the cost of the extra decode steps,
    # without what every call pays once (CUDA-graph capture, the first token's prefill of the last prompt token)
    half = gen_tokens // 2
    with Timer() as t_half:
        generate_from_state(state, model, args.groups, half, eos_token_id=None)
    with Timer() as t_gen:
        ids = generate_from_state(state, model, args.groups, gen_tokens, eos_token_id=None)
    assert ids.shape == (args.groups, gen_tokens), ids.shape
    gen_peak = peak_gib()
    gen_streamed, streamed = streamed_bytes() - streamed, streamed_bytes()
    per_token = (t_gen.seconds - t_half.seconds) / (gen_tokens - half)
    marginal_ok = per_token > 0  # (timing noise of a few-token CPU smoke can invert the two calls)
    if not marginal_ok:
        per_token = t_gen.seconds / gen_tokens
    result.update(
        {
            "generation_tokens": gen_tokens,
            "generation_cuda_graph": graphed,
            "generation_s": t_gen.seconds,
            "generation_s_half_call": t_half.seconds,
            "generation_s_per_token": per_token,
            "generation_s_per_token_whole_call": t_gen.seconds / gen_tokens,
            "generation_per_token_is_marginal": marginal_ok,
            "generation_s_projected_R": t_gen.seconds - gen_tokens * per_token + args.response * per_token,
            "generation_floor_s_R": fl["gen_step"] * args.response,
            "generation_over_floor": per_token / fl["gen_step"],
            "generation_peak_gib": gen_peak,
            "h2d_bytes_per_token": gen_streamed / (half + gen_tokens),  # over both calls' steps
        }
    )
    save()
    replay_ids = torch.randint(0, config.vocab_size, (args.groups, args.response), device=dev)
    reset_peak()
    times = []
    for i in range(replays or args.groups):
        with Timer() as t:
            logp = replay_logprobs(state, model, replay_ids[i][None], grad=True)
            (-logp.mean()).backward()
        times.append(t.seconds)
    per = mean_after_first(times)
    result.update(
        {
            "G": args.groups,
            "replay_s_per_response": per,
            "replay_s_first": times[0],
            "replay_floor_s": fl["replay"],
            "replay_over_floor": per / fl["replay"],
            "replay_peak_gib": peak_gib(),
            "h2d_bytes_per_response": (streamed_bytes() - streamed) / args.groups,
        }
    )
    del state
    save()


def copy_overlap(host: dict, gpu: dict, h2d_gbs: float) -> dict:
    """How much of the host case's copying its compute hides, per phase, against the GPU-state case at the same
    P: the copy alone (bytes streamed / the measured host-to-device rate), the host case's extra seconds over
    the GPU case, and ``hidden = 1 - extra / copy`` clamped to [0, 1] (1: the copies cost nothing; 0: they
    add at least their own time). Decode only when both cases timed it the same way (marginal per token)."""
    phases = {
        "capture": ("capture_s", "h2d_bytes_capture"),
        "replay, per response": ("replay_s_per_response", "h2d_bytes_per_response"),
    }
    if host.get("generation_per_token_is_marginal") and gpu.get("generation_per_token_is_marginal"):
        phases["decode, per token"] = ("generation_s_per_token", "h2d_bytes_per_token")
    out = {}
    for name, (seconds, nbytes) in phases.items():
        copy_s = host[nbytes] / (h2d_gbs * 1e9)
        extra_s = host[seconds] - gpu[seconds]
        hidden = min(1.0, max(0.0, 1 - extra_s / copy_s)) if copy_s > 0 else None
        out[name] = {"copy_s": copy_s, "extra_s": extra_s, "hidden": hidden}
    return out


def estimate_s(done: list[dict], config, counts, p: int, offload: bool, args, rates: dict) -> float:
    """Seconds a case should take: the indexer's top-k flow at its measured ns per score, every other part at
    its floor times the ratio measured/floor of the last case run (of the same storage if any; before any,
    ``args.first_case_ratio``). Generation runs 1.5x the tokens (a half call, then the whole one)."""
    done = [r for r in done if "replay_s_per_response" in r]
    same = [r for r in done if (r["state_bytes_host"] > 0) == offload] or done
    flow = rates["indexer_topk_ns_per_score"] * 1e-9
    cap_ratio = gen_ratio = rep_ratio = args.first_case_ratio
    if same:
        r = same[-1]
        indexer_s = r["capture_indexer_scores"] * flow
        cap_ratio = max(r["capture_s"] - indexer_s, 0.0) / r["capture_other_floor_s"]
        gen_ratio, rep_ratio = r["generation_over_floor"], r["replay_over_floor"]
    fl = floors(config, counts, p, args, rates, offload)
    tokens = args.offload_gen_tokens if offload else args.gen_tokens
    return (
        fl["indexer_scores"] * flow
        + fl["capture_other"] * cap_ratio
        + fl["gen_step"] * 1.5 * tokens * gen_ratio
        + fl["replay"] * args.groups * rep_ratio
    )


def case_line(r: dict) -> str:
    """One line per case, printed when it ends."""
    return (
        f"P={r['prompt_tokens']} {'host' if r['state_bytes_host'] else 'gpu'} state "
        f"({max(r['state_bytes_gpu'], r['state_bytes_host']) / GiB:.2f} GiB): capture {r['capture_s']:.1f} s "
        f"(x{r['capture_over_floor']:.1f} floor, peak {r['capture_peak_gib']:.1f} GiB), gen "
        f"{r['generation_s_per_token']:.4f} s/tok (x{r['generation_over_floor']:.1f}, peak "
        f"{r['generation_peak_gib']:.1f}), replay {r['replay_s_per_response']:.2f} s/resp "
        f"(x{r['replay_over_floor']:.1f}, peak {r['replay_peak_gib']:.1f}); case {r['case_s']:.0f} s "
        f"(estimated {r['estimate_s']:.0f})"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, nargs="+", default=[1 << 20, 1 << 21])
    ap.add_argument("--storage", nargs="+", default=["gpu", "cpu"], choices=["gpu", "cpu"])
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--indexer-types", default="full,shared,shared")
    ap.add_argument("--groups", type=int, default=8, help="G")
    ap.add_argument("--response", type=int, default=2048, help="R")
    ap.add_argument(
        "--gen-tokens", type=int, default=None, help="tokens decoded with resident state (default R)"
    )
    ap.add_argument("--offload-gen-tokens", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=16384)
    ap.add_argument("--page", type=int, default=16384)
    ap.add_argument(
        "--budget-s", type=float, default=540.0, help="skip cases estimated past this (s, from start)"
    )
    ap.add_argument(
        "--first-case-ratio",
        type=float,
        default=5.0,
        help="measured/floor assumed for the first case's estimate (the budget check); later cases use the "
        "ratios measured before them (a 1M case on the H200 ran at 4-5x its floors)",
    )
    ap.add_argument(
        "--gpu-reference",
        nargs="*",
        default=[],
        help="JSON files of earlier runs of this script whose GPU-state cases pair with this run's host-state "
        "ones (same dimensions) for the copy overlap; a GPU case of this run at the same P is preferred",
    )
    ap.add_argument(
        "--warmup-prompt",
        type=int,
        default=None,
        help="P of an unmeasured case per storage run first (0: none; default 3 chunks, none with --smoke): "
        "whole chunks and the last one a row short, as every measured P has them",
    )
    ap.add_argument("--tag", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU dry run with tiny widths")
    args = ap.parse_args()
    start = time.perf_counter()
    dev = "cpu" if args.smoke else "cuda"
    args.gen_tokens = args.gen_tokens or args.response
    if args.warmup_prompt is None:
        args.warmup_prompt = 0 if args.smoke else 3 * args.chunk
    types = args.indexer_types.split(",")
    if len(types) != args.layers:
        raise SystemExit(f"--indexer-types has {len(types)} entries for {args.layers} layers")

    torch.manual_seed(0)
    config = slice_config(args.layers, types, max(args.prompt) + args.response + 16, args.smoke)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    for name, param in model.named_parameters():
        if ".experts." in name:
            param.requires_grad_(False)
    model.train()
    counts = param_counts(model, config)
    weights_gib = allocated_gib() if not args.smoke else 0.0
    small_diff = check_small(model, config, dev)
    nan = float("nan")
    rates = {
        "matmul_tflops": matmul_tflops() if not args.smoke else 1.0,
        "copy_gbs": copy_bandwidth_gbs() if not args.smoke else 10.0,
        "h2d_gbs": h2d_bandwidth_gbs() if not args.smoke else 10.0,
        **indexer_probe(config, dev, args.smoke),
    }
    # first, so a run cut short still shows the rates
    print(
        f"glm-5 x{args.layers} layers ({types}): weights {weights_gib:.1f} GiB; GEMM {rates['matmul_tflops']:.0f} "
        f"TFLOP/s, copy {rates['copy_gbs']:.0f} GB/s, H2D {rates['h2d_gbs']:.0f} GB/s; indexer "
        f"{'kernel' if rates['indexer_kernel'] else 'torch path'} {rates['indexer_tflops']:.0f} TFLOP/s, top-k flow "
        f"{rates['indexer_topk_ns_per_score']:.4f} ns/score; small bf16 check |dlogp| max/mean: all keys "
        f"{small_diff['all_keys_max']:.3g}/{small_diff['all_keys_mean']:.3g}, index_topk "
        f"{small_diff['index_topk_max']:.3g}/{small_diff['index_topk_mean']:.3g}",
        flush=True,
    )
    print(
        "top-k flow ns/score (top-k alone ns/element) by buffer elements: "
        + ", ".join(
            f"2^{e.bit_length() - 1} {v:.4f} ({rates['topk_alone_ns_per_element_by_buffer_elements'][e]:.4f})"
            for e, v in rates["indexer_topk_ns_per_score_by_buffer_elements"].items()
        ),
        flush=True,
    )
    cases = [(p, s == "cpu") for p in sorted(args.prompt) for s in args.storage]
    results, skipped = [], []
    payload = {
        "model": f"glm-5 layer dimensions, {args.layers} layers (1 dense, {args.layers - 1} MoE), indexer types "
        f"{types}, random init, bf16, routed experts frozen",
        "preset": "glm-5",
        "layers": args.layers,
        "indexer_types": types,
        "response_tokens": args.response,
        "groups": args.groups,
        "chunk_size": args.chunk,
        "page_size": args.page,
        "weights_gib": weights_gib,
        "params": counts,
        "small_check_abs_logprob_diff_bf16": small_diff,
        "rates_measured": rates if not args.smoke else {k: nan for k in rates},
        "results": results,
        "skipped": skipped,
    }
    name = f"glm_slice_{args.layers}L{args.tag}"
    path = write_result(name, payload)
    if args.warmup_prompt:  # Triton compiles (and autotunes) here, not inside the first measured case
        for offload in dict.fromkeys(s == "cpu" for s in args.storage):
            t0, warm = time.perf_counter(), {}
            run_case(
                model, config, counts, args, args.warmup_prompt, offload, dev, rates, warm, lambda: None, 8, 2
            )
            payload.setdefault("warmup_s", []).append(time.perf_counter() - t0)
            print(
                f"warm-up P={args.warmup_prompt} {'host' if offload else 'gpu'} state: {payload['warmup_s'][-1]:.1f} s"
            )
    for p, offload in cases:  # written after each case, so a run cut short keeps what it measured
        t0 = time.perf_counter()
        left = args.budget_s - (t0 - start)
        est = estimate_s(results, config, counts, p, offload, args, rates)
        if est > left:
            skipped.append({"prompt_tokens": p, "offload": offload, "estimate_s": est, "left_s": left})
            print(f"skipped P={p} offload={offload}: estimate {est:.0f} s > {left:.0f} s left", flush=True)
        else:
            results.append({"estimate_s": est})
            run_case(
                model,
                config,
                counts,
                args,
                p,
                offload,
                dev,
                rates,
                results[-1],
                lambda: write_result(name, payload),
            )
            results[-1]["case_s"] = time.perf_counter() - t0
            print(case_line(results[-1]), flush=True)
        path = write_result(name, payload)
    references = []
    for f in args.gpu_reference:  # (a reference file that is not there: none)
        if Path(f).is_file():
            references += json.loads(Path(f).read_text())["results"]
        else:
            print(f"no GPU-state reference at {f}: host cases pair only with this run's", flush=True)
    for host in (r for r in results if r.get("state_bytes_host") and "replay_s_per_response" in r):
        pair = [
            r
            for r in [*references, *results]  # this run's last: it wins
            if not r.get("state_bytes_host")
            and r.get("prompt_tokens") == host["prompt_tokens"]
            and "replay_s_per_response" in r
        ]
        if pair:
            host["copy_overlap"] = copy_overlap(host, pair[-1], rates["h2d_gbs"])
            print(
                f"P={host['prompt_tokens']} host state, copies hidden: "
                + ", ".join(
                    f"{k} {v['hidden']:.0%} of {v['copy_s']:.2f} s"
                    if v["hidden"] is not None
                    else f"{k} none"
                    for k, v in host["copy_overlap"].items()
                ),
                flush=True,
            )
    path = write_result(name, payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
