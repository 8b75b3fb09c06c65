"""Capture a long prompt once, then score and replay responses on its state (CPU-friendly).

    python examples/capture_replay.py --prompt-tokens 4096

Builds a small random-init Qwen3 model, captures the prompt in chunks, prints the state's bytes by kind,
compares the replayed log-probs with the stock model's full forward, and backpropagates one response.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from longstraw_trl import capture_prompt, generate_from_state, replay_logprobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--response-tokens", type=int, default=64)
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument("--chunk-size", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=2048)
    args = ap.parse_args()

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=args.prompt_tokens + args.response_tokens,
    )
    model = AutoModelForCausalLM.from_config(config).float()
    prompt = torch.randint(0, config.vocab_size, (args.prompt_tokens,))

    t0 = time.perf_counter()
    state = capture_prompt(model, prompt, chunk_size=args.chunk_size, page_size=args.page_size)
    print(f"captured {state.num_tokens} tokens in {time.perf_counter() - t0:.2f} s: {state}")
    print(f"state bytes by kind {state.nbytes_by_kind()}, page slack {state.slack_bytes()} B")

    completions = generate_from_state(
        state, model, args.num_generations, args.response_tokens, temperature=1.0
    )
    logps = replay_logprobs(state, model, completions)
    with torch.no_grad():
        full = torch.cat([prompt[None].expand(len(completions), -1), completions], 1)
        logits = model(full).logits[:, args.prompt_tokens - 1 : -1].float()
    ref = torch.log_softmax(logits, -1).gather(-1, completions[..., None])[..., 0]
    print(f"mean log-prob per response: {[round(x, 3) for x in logps.mean(1).tolist()]}")
    print(f"max |replay - stock full forward| = {(logps - ref).abs().max().item():.2e}")

    t0 = time.perf_counter()
    for i in range(len(completions)):  # one response's graph at a time
        loss = -replay_logprobs(state, model, completions[i : i + 1], grad=True).mean()
        loss.backward()
    print(f"replayed {len(completions)} responses with backward in {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
