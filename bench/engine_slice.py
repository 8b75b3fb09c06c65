"""Engine on a real-dimension model slice: capture P tokens, replay G responses with backward.

Presets (``longstraw_trl.presets``): ``qwen3-8b`` (hidden 4096, 32 q / 8 kv heads of 128, intermediate
12288, vocab 151936) and ``qwen3.6-27b`` (hidden 5120, 24 q / 4 kv heads of 256, GDN 16 key / 48 value
heads of 128, intermediate 17408, vocab 248320; 3 GDN layers then 1 full attention), with fewer layers
(``--layers``, default 4), random weights, bf16, full fine-tuning (every parameter gets a gradient).
Reports peak memory, state bytes by kind, capture seconds against the attention floor (causal SDPA rate
measured in the same run), replay seconds per response, and the peak for each G (it must not grow with
G: one response's graph at a time).

    python bench/engine_slice.py --preset qwen3-8b --prompt 1048576 --groups 2 8
    python bench/engine_slice.py --preset qwen3.6-27b --prompt 1048576 2097152 --groups 8
"""

from __future__ import annotations

import argparse

import torch
from common import (
    GiB,
    Timer,
    copy_bandwidth_gbs,
    matmul_tflops,
    mean_after_first,
    peak_gib,
    print_table,
    reset_peak,
    sdpa_causal_tflops,
    write_result,
)
from transformers import AutoModelForCausalLM

from longstraw_trl import capture_prompt, generate_from_state, replay_logprobs
from longstraw_trl.presets import preset_config


def slice_config(preset: str, layers: int, max_positions: int, tiny: bool = False):
    if tiny:  # a dry run of the script itself on CPU: same layer pattern, tiny widths
        return preset_config(
            preset,
            layers,
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            max_position_embeddings=max_positions,
        )
    return preset_config(preset, layers, max_position_embeddings=max_positions)


def check_small(model, vocab: int, device: str) -> float:
    """bf16 log-probs against the stock model's own forward at a small size (sanity on this device)."""
    g = torch.Generator(device=device).manual_seed(0)
    prompt = torch.randint(0, vocab, (4096,), device=device, generator=g)
    comp = torch.randint(0, vocab, (2, 256), device=device, generator=g)
    state = capture_prompt(model, prompt, chunk_size=1024, page_size=1536)
    got = replay_logprobs(state, model, comp)
    with torch.no_grad():
        full = torch.cat([prompt[None].expand(2, -1), comp], 1)
        logits = model(full).logits[:, 4095:-1].float()
    ref = torch.log_softmax(logits, -1).gather(-1, comp[..., None])[..., 0]
    return (got - ref).abs().max().item()


def full_attention_layers(config) -> int:
    types = getattr(config, "layer_types", None)
    return sum(t == "full_attention" for t in types) if types else config.num_hidden_layers


def dense_parameters(model) -> int:
    """Parameters every token multiplies through (all but the input embedding, which is a gather)."""
    embed = model.get_input_embeddings().weight
    return sum(p.numel() for p in model.parameters() if p is not embed)


def run_prompt(model, config, args, prompt_len: int, dev: str, rates: dict) -> dict:
    """Capture, generate G responses, replay them with backward; each time against its floor.

    Floors (rates measured in the same run): capture = full-attention FLOPs at the causal SDPA rate + dense
    FLOPs (2 per decoder parameter per token; no output head: capture computes no logits) at the GEMM
    rate; generation = bytes read per decode step (weights and the prompt state, read once for all G
    rows) at the copy bandwidth; replay = the larger of its FLOPs
    (attention over the pages: 4 per q-k pair forward, 6 backward for dQ; dense: 6 per parameter per token)
    and its bytes (pages read forward and backward, weights three times). GDN recurrences are not counted.
    """
    model.zero_grad(set_to_none=True)  # nothing left from the previous P while capturing this one
    prompt = torch.randint(0, config.vocab_size, (prompt_len,), device=dev)
    reset_peak()
    with Timer() as t_cap:
        state = capture_prompt(model, prompt, chunk_size=args.chunk, page_size=args.page, progress=False)
    capture_peak = peak_gib()
    heads, hd, n_full = config.num_attention_heads, config.head_dim, full_attention_layers(config)
    dense = dense_parameters(model)
    head = model.get_output_embeddings().weight.numel()  # capture keeps the last hidden state, no logits
    weight_bytes = dense * 2
    attn_flops = 4 * heads * hd * prompt_len**2 / 2 * n_full
    cap_attn_floor = attn_flops / (rates["sdpa_tflops"] * 1e12)
    cap_dense_floor = 2 * (dense - head) * prompt_len / (rates["matmul_tflops"] * 1e12)
    bandwidth = rates["copy_gbs"] * 1e9

    g_max, r = max(args.groups), args.response
    reset_peak()
    with Timer() as t_gen:
        ids = generate_from_state(state, model, g_max, r, eos_token_id=None)
    assert ids.shape == (g_max, r), ids.shape
    gen_floor = r * (weight_bytes + state.nbytes()) / bandwidth
    generation = {
        "G": g_max,
        "generation_s": t_gen.seconds,
        "generation_floor_s": gen_floor,
        "generation_over_floor": t_gen.seconds / gen_floor,
        "generation_peak_gib": peak_gib(),
    }

    rep_flops_floor = 10 * heads * hd * r * prompt_len * n_full / (
        rates["sdpa_tflops"] * 1e12
    ) + 6 * dense * r / (rates["matmul_tflops"] * 1e12)
    rep_bytes_floor = (2 * state.nbytes() + 3 * weight_bytes) / bandwidth
    rep_floor = max(rep_flops_floor, rep_bytes_floor)
    replays = []
    for g in args.groups:
        reset_peak()
        times = []
        for i in range(g):
            with Timer() as t:
                logp = replay_logprobs(state, model, ids[i % g_max][None], grad=True)
                (-logp.mean()).backward()
            times.append(t.seconds)
        per = mean_after_first(times)
        replays.append(
            {
                "G": g,
                "replay_s_per_response": per,
                "replay_s_first": times[0],
                "replay_over_floor": per / rep_floor,
                "replay_peak_gib": peak_gib(),
            }
        )
    result = {
        "prompt_tokens": prompt_len,
        "state_bytes": state.nbytes(),
        "state_bytes_by_kind": state.nbytes_by_kind(),
        "state_slack_bytes": state.slack_bytes(),
        "capture_s": t_cap.seconds,
        "capture_peak_gib": capture_peak,
        "capture_attention_floor_s": cap_attn_floor,
        "capture_dense_floor_s": cap_dense_floor,
        "capture_floor_s": cap_attn_floor + cap_dense_floor,
        "capture_over_floor": t_cap.seconds / (cap_attn_floor + cap_dense_floor),
        "generation": generation,
        "replay_flops_floor_s": rep_flops_floor,
        "replay_bytes_floor_s": rep_bytes_floor,
        "replay_floor_s": rep_floor,
        "replays": replays,
    }
    del state
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-8b", choices=["qwen3-8b", "qwen3.6-27b"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, nargs="+", default=[1 << 20])
    ap.add_argument("--response", type=int, default=2048)
    ap.add_argument("--groups", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--chunk", type=int, default=16384)
    ap.add_argument("--page", type=int, default=16384)
    ap.add_argument("--tag", default="", help="suffix of the JSON name (keeps earlier runs' files)")
    ap.add_argument("--tiny", action="store_true", help="dry run on CPU with tiny dimensions")
    args = ap.parse_args()
    dev = "cpu" if args.tiny else "cuda"

    torch.manual_seed(0)
    config = slice_config(
        args.preset, args.layers, max(max(args.prompt) + args.response, 4352) + 16, args.tiny
    )
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.train()
    weights_gib = torch.cuda.memory_allocated() / GiB if not args.tiny else 0.0
    small_diff = check_small(model, config.vocab_size, dev)
    # warm-up at the run's chunk size: Triton kernels compile (and autotune) on their first call per shape
    warm = capture_prompt(
        model,
        torch.randint(0, config.vocab_size, (2 * args.chunk,), device=dev),
        chunk_size=args.chunk,
        page_size=args.page,
        progress=False,
    )
    del warm
    heads, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    nan = float("nan")
    rates = {
        "sdpa_tflops": sdpa_causal_tflops(heads, kv, hd) if not args.tiny else nan,
        "matmul_tflops": matmul_tflops() if not args.tiny else nan,
        "copy_gbs": copy_bandwidth_gbs() if not args.tiny else nan,
    }

    results = []
    payload = {
        "model": f"{args.preset} layer dimensions, {args.layers} layers "
        f"({full_attention_layers(config)} full attention), random init, bf16, full fine-tuning",
        "preset": args.preset,
        "layers": args.layers,
        "response_tokens": args.response,
        "chunk_size": args.chunk,
        "page_size": args.page,
        "weights_gib": weights_gib,
        "small_check_max_abs_logprob_diff_bf16": small_diff,
        "sdpa_causal_tflops_measured": rates["sdpa_tflops"],
        "matmul_tflops_measured": rates["matmul_tflops"],
        "copy_bandwidth_gbs_measured": rates["copy_gbs"],
        "gradients_kept_during_capture": False,
        "results": results,
    }
    for p in args.prompt:  # written after each P, so a run cut short keeps what it measured
        results.append(run_prompt(model, config, args, p, dev, rates))
        path = write_result(f"engine_{args.preset}_{args.layers}L{args.tag}", payload)
    print(
        f"{args.preset} x{args.layers} layers: weights {weights_gib:.2f} GiB; SDPA causal "
        f"{rates['sdpa_tflops']:.0f} TFLOP/s, GEMM {rates['matmul_tflops']:.0f} TFLOP/s, "
        f"copy {rates['copy_gbs']:.0f} GB/s"
    )
    print(f"small bf16 check vs stock forward: max |dlogp| = {small_diff:.3g}")
    rows = []
    for r in results:
        for rep in r["replays"]:
            rows.append(
                {
                    "P": r["prompt_tokens"],
                    "state GiB": f"{r['state_bytes'] / GiB:.2f}",
                    "by kind MiB": " ".join(
                        f"{k}={v / 2**20:.0f}" for k, v in r["state_bytes_by_kind"].items()
                    ),
                    "capture s": f"{r['capture_s']:.1f}",
                    "cap/floor": f"{r['capture_over_floor']:.1f}",
                    "cap peak GiB": f"{r['capture_peak_gib']:.1f}",
                    "gen s": f"{r['generation']['generation_s']:.1f}",
                    "gen/floor": f"{r['generation']['generation_over_floor']:.1f}",
                    "G": rep["G"],
                    "replay s/resp": f"{rep['replay_s_per_response']:.2f}",
                    "rep/floor": f"{rep['replay_over_floor']:.1f}",
                    "replay peak GiB": f"{rep['replay_peak_gib']:.1f}",
                }
            )
    print_table(rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
