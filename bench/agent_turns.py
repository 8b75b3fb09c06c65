"""Tool turns on a shared long prompt: the prompt is captured once, each turn only extends each rollout.

What the trainer does when a rollout calls a tool (``longstraw_trl.state_cache.PromptStateCache``, the same
code): G rollouts are sampled from one captured prompt state; at each turn every rollout's history grows by
its own completion and a tool result, and the cache builds the longer prompt by extending the rollout's
previous state (a fork sharing every earlier page) with only the new tokens; the rollout then continues
from it. At the end every whole rollout (completions and tool results) is replayed once with backward
from the *original* prompt state, as the loss does. Reports per turn the extend seconds and tokens, the
generation seconds, the peak memory and the state bytes held (shared pages counted once): the peak must
stay flat across turns, and nothing but the new tokens is ever prefilled.

Qwen3.6-27B slice (real widths, ``--layers``, default 4: 3 GDN + 1 attention), random bf16 weights, full
fine-tuning. Random tokens stand for completions and tool results.

    python bench/agent_turns.py --prompt 524288 --generations 8 --turns 3
"""

from __future__ import annotations

import argparse

import torch
from common import GiB, Timer, peak_gib, print_table, reset_peak, write_result
from engine_slice import slice_config
from transformers import AutoModelForCausalLM

from longstraw_trl import capture_prompt, extend_state, generate_from_state, replay_logprobs
from longstraw_trl.refresh import RefreshPolicy
from longstraw_trl.state_cache import PromptStateCache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.6-27b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=524288)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--response", type=int, default=256, help="tokens each rollout generates per turn")
    ap.add_argument("--tool-tokens", type=int, default=512, help="tokens of each tool result")
    ap.add_argument("--chunk", type=int, default=16384)
    ap.add_argument("--page", type=int, default=16384)
    ap.add_argument("--tiny", action="store_true", help="CPU dry run with tiny widths")
    args = ap.parse_args()
    dev = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    total = args.prompt + args.turns * (args.response + args.tool_tokens) + args.response + 16
    config = slice_config(args.preset, args.layers, total, tiny=args.tiny)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    gen = torch.Generator(device=dev).manual_seed(0)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, config.vocab_size, (n,), device=dev, generator=gen)

    prefills = []

    def capture(ids):
        prefills.append(("capture", ids.numel()))
        return capture_prompt(model, ids.to(dev), chunk_size=args.chunk, page_size=args.page)

    def extend(state, more):
        prefills.append(("extend", more.numel()))
        return extend_state(state, model, more)

    cache = PromptStateCache(
        capture, extend, RefreshPolicy("recapture"), max_bytes=None, prompt_prefix_sharing=True
    )
    prompt = tokens(args.prompt).cpu()
    rows = []
    with torch.no_grad():
        reset_peak()
        with Timer() as t:
            root = cache.get(prompt, step=0).entry
        with Timer() as t_gen:
            first = generate_from_state(root.state, model, args.generations, args.response, generator=gen)
        rows.append(
            {
                "turn": 0,
                "prefilled_tokens": args.prompt,
                "prefill_s": t.seconds,
                "generation_s": t_gen.seconds,
                "peak_gib": peak_gib(),
                "state_gib": cache.nbytes() / GiB,
            }
        )
        histories = [prompt.clone() for _ in range(args.generations)]
        completions = [first[g].cpu() for g in range(args.generations)]
        whole = [c.clone() for c in completions]  # what each rollout's loss replays after the prompt
        for turn in range(1, args.turns + 1):
            reset_peak()
            extend_s, gen_s, before = 0.0, 0.0, len(prefills)
            for g in range(args.generations):
                tool = tokens(args.tool_tokens).cpu()
                histories[g] = torch.cat([histories[g], completions[g], tool])
                with Timer() as t:
                    lookup = cache.get(histories[g], step=0)
                assert lookup.action == "extend", lookup.action
                extend_s += t.seconds
                with Timer() as t:
                    completions[g] = generate_from_state(
                        lookup.entry.state, model, 1, args.response, generator=gen
                    )[0].cpu()
                gen_s += t.seconds
                whole[g] = torch.cat([whole[g], tool, completions[g]])
            new = [n for kind, n in prefills[before:]]
            assert all(kind == "extend" for kind, _ in prefills[before:])
            rows.append(
                {
                    "turn": turn,
                    "prefilled_tokens": sum(new),
                    "prefill_s": extend_s,
                    "generation_s": gen_s,
                    "peak_gib": peak_gib(),
                    "state_gib": cache.nbytes() / GiB,
                }
            )
    # the loss: every whole rollout replayed with backward from the original prompt state
    reset_peak()
    replay_s = []
    for g in range(args.generations):
        with Timer() as t:
            (-replay_logprobs(root.state, model, whole[g][None].to(dev), grad=True).mean()).backward()
        replay_s.append(t.seconds)
    replay = {"tokens": int(whole[0].numel()), "seconds": replay_s, "peak_gib": peak_gib()}
    captures = [n for kind, n in prefills if kind == "capture"]
    assert captures == [args.prompt], captures  # the prompt, once
    print_table(rows)
    print(f"replay of {replay['tokens']} tokens with backward, per rollout: {max(replay_s):.2f} s max; "
          f"peak {replay['peak_gib']:.1f} GiB")  # fmt: skip
    write_result(
        f"agent_turns_{args.preset}_{args.layers}L" + ("_tiny" if args.tiny else ""),
        {
            "preset": args.preset,
            "layers": args.layers,
            "prompt_tokens": args.prompt,
            "generations": args.generations,
            "turns": args.turns,
            "response_tokens_per_turn": args.response,
            "tool_tokens_per_turn": args.tool_tokens,
            "captures": captures,
            "turns_table": rows,
            "replay": replay,
            "description": "prompt captured once; each tool turn extends every rollout's own state "
            "(PromptStateCache, the trainer's code path) by its completion and the tool result",
        },
    )


if __name__ == "__main__":
    main()
