"""Engine on a Qwen3-8B-dimension slice: capture P tokens, replay G responses with backward.

Real Qwen3-8B layer dimensions (hidden 4096, 32 q / 8 kv heads of 128, intermediate 12288, vocab 151936)
with fewer layers (``--layers``, default 4), random weights, bf16, full fine-tuning (every parameter
gets a gradient). Reports peak memory, state bytes, capture seconds, replay seconds per response, and
the peak for each G (it must not grow with G: one response's graph at a time).

    python bench/engine_gqa.py --prompt 1048576 --response 2048 --groups 2 8
"""

from __future__ import annotations

import argparse

import torch
from common import GiB, Timer, peak_gib, print_table, reset_peak, sdpa_causal_tflops, sync, write_result
from transformers import AutoModelForCausalLM, Qwen3Config

from longstraw_trl import capture_prompt


def qwen3_8b_slice(layers: int, max_positions: int, tiny: bool = False) -> Qwen3Config:
    if tiny:  # a dry run of the script itself on CPU
        return Qwen3Config(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=max_positions,
        )
    return Qwen3Config(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=max_positions,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
    )


def check_small(model, vocab: int, device: str) -> float:
    """bf16 log-probs against the stock model's own forward at a small size (sanity on this device)."""
    g = torch.Generator(device=device).manual_seed(0)
    prompt = torch.randint(0, vocab, (4096,), device=device, generator=g)
    comp = torch.randint(0, vocab, (2, 256), device=device, generator=g)
    state = capture_prompt(model, prompt, chunk_size=1024, page_size=1536)
    got = state.logprobs(model, comp)
    with torch.no_grad():
        full = torch.cat([prompt[None].expand(2, -1), comp], 1)
        logits = model(full).logits[:, 4095:-1].float()
    ref = torch.log_softmax(logits, -1).gather(-1, comp[..., None])[..., 0]
    return (got - ref).abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=1 << 20)
    ap.add_argument("--response", type=int, default=2048)
    ap.add_argument("--groups", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--chunk", type=int, default=16384)
    ap.add_argument("--page", type=int, default=16384)
    ap.add_argument("--tiny", action="store_true", help="dry run on CPU with tiny dimensions")
    args = ap.parse_args()
    dev = "cpu" if args.tiny else "cuda"

    torch.manual_seed(0)
    config = qwen3_8b_slice(args.layers, max(args.prompt + args.response, 4352) + 16, args.tiny)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.train()
    weights_gib = torch.cuda.memory_allocated() / GiB if not args.tiny else 0.0
    small_diff = check_small(model, config.vocab_size, dev)
    rate = sdpa_causal_tflops(32, 8, 128) if not args.tiny else float("nan")

    prompt = torch.randint(0, config.vocab_size, (args.prompt,), device=dev)
    reset_peak()
    with Timer() as t_cap:
        state = capture_prompt(model, prompt, chunk_size=args.chunk, page_size=args.page, progress=False)
    capture_peak = peak_gib()
    attn_flops = 4 * 32 * 128 * args.prompt**2 / 2 * args.layers
    by_kind = state.nbytes_by_kind()

    rows, results = [], []
    for g in args.groups:
        reset_peak()
        times = []
        for _ in range(g):
            comp = torch.randint(0, config.vocab_size, (1, args.response), device=dev)
            with Timer() as t:
                logp = state.logprobs(model, comp, grad=True)
                (-logp.mean()).backward()
            times.append(t.seconds)
        sync()
        res = {
            "G": g,
            "replay_s_per_response": sum(times[1:]) / max(1, len(times) - 1) if g > 1 else times[0],
            "replay_s_first": times[0],
            "peak_gib": peak_gib(),
        }
        results.append(res)
        rows.append({k: (f"{v:.2f}" if isinstance(v, float) else v) for k, v in res.items()})

    payload = {
        "model": "Qwen3-8B layer dimensions, random init, bf16",
        "layers": args.layers,
        "prompt_tokens": args.prompt,
        "response_tokens": args.response,
        "chunk_size": args.chunk,
        "page_size": args.page,
        "weights_gib": weights_gib,
        "small_check_max_abs_logprob_diff_bf16": small_diff,
        "state_bytes": state.nbytes(),
        "state_bytes_by_kind": by_kind,
        "state_slack_bytes": state.slack_bytes(),
        "capture_s": t_cap.seconds,
        "capture_peak_gib": capture_peak,
        "sdpa_causal_tflops_measured": rate,
        "capture_attention_floor_s": attn_flops / (rate * 1e12),
        "replays": results,
    }
    path = write_result(f"engine_gqa_P{args.prompt}", payload)
    print(
        f"weights {weights_gib:.2f} GiB; state {state.nbytes() / GiB:.2f} GiB {by_kind}; slack {state.slack_bytes()}"
    )
    print(f"small bf16 check vs stock forward: max |dlogp| = {small_diff:.3g}")
    print(
        f"capture {t_cap.seconds:.1f} s (attention floor {payload['capture_attention_floor_s']:.1f} s at "
        f"{rate:.0f} TFLOP/s), capture peak {capture_peak:.2f} GiB"
    )
    print_table(rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
