"""Capture a long prompt once, then score and replay responses on its state (CPU-friendly).

    python examples/capture_replay.py --prompt-tokens 4096

Builds a small random-init Qwen3 model, captures the prompt in chunks, prints the state's bytes by kind,
compares the replayed log-probs with the stock model's full forward, and backpropagates every response, one at a
time.
"""
# ruff: noqa: E402 (the options are parsed before torch and transformers load, so --help answers at once)

from __future__ import annotations

import argparse
import time

from _common import add_threads_option, use_threads


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--prompt-tokens", type=int, default=4096, help="prompt length P")
    ap.add_argument("--response-tokens", type=int, default=64, help="tokens per response")
    ap.add_argument("--num-generations", type=int, default=4, help="responses sampled from the state (G)")
    ap.add_argument("--chunk-size", type=int, default=1024, help="tokens per capture chunk")
    ap.add_argument("--page-size", type=int, default=2048, help="tokens per K/V page")
    add_threads_option(ap)
    return ap.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and wrong options end here, before the imports below (torch, transformers: seconds)

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from longstraw_trl import capture_prompt, generate_from_state, replay_logprobs


def small_qwen3(max_positions: int):
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_positions,
    )
    return AutoModelForCausalLM.from_config(config).float()


def stock_logprobs(model, prompt: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
    """The completions' token log-probs from the stock model's forward over ``prompt + completion``."""
    with torch.no_grad():
        full = torch.cat([prompt[None].expand(len(completions), -1), completions], 1)
        logits = model(full).logits[:, prompt.numel() - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, completions[..., None])[..., 0]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    use_threads(args.threads)
    model = small_qwen3(args.prompt_tokens + args.response_tokens)
    prompt = torch.randint(0, model.config.vocab_size, (args.prompt_tokens,))

    t0 = time.perf_counter()
    state = capture_prompt(model, prompt, chunk_size=args.chunk_size, page_size=args.page_size)
    print(f"captured {state.num_tokens} tokens in {time.perf_counter() - t0:.2f} s: {state}")
    print(f"state bytes by kind {state.nbytes_by_kind()}, page slack {state.slack_bytes()} B")

    completions = generate_from_state(
        state, model, args.num_generations, args.response_tokens, temperature=1.0
    )
    logps = replay_logprobs(state, model, completions)
    max_diff = (logps - stock_logprobs(model, prompt, completions)).abs().max().item()
    print(f"mean log-prob per response: {[round(x, 3) for x in logps.mean(1).tolist()]}")
    print(f"max |replay - stock full forward| = {max_diff:.2e}")

    t0 = time.perf_counter()
    for i in range(len(completions)):  # one response's graph at a time
        loss = -replay_logprobs(state, model, completions[i : i + 1], grad=True).mean()
        loss.backward()
    print(f"replayed {len(completions)} responses with backward in {time.perf_counter() - t0:.2f} s")
    return {
        "prompt_tokens": state.num_tokens,
        "completions": completions.shape[0],
        "max_abs_logprob_difference": max_diff,
        "grad_norm": sum(p.grad.norm() ** 2 for p in model.parameters() if p.grad is not None).item() ** 0.5,
    }


if __name__ == "__main__":
    main()
