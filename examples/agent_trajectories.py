"""Agent trajectories with LongStrawGRPOTrainer: one row per decision point, each extending the previous one's state.

    python examples/agent_trajectories.py              # CPU: about a minute
    python examples/agent_trajectories.py --steps 1 --trajectories 1   # the reduced run of tests/test_examples_agents.py

What it does:
1. builds with `datasets` a few multi-turn agent trajectories: a system message, a task, then assistant actions that
   call a `read_page` tool and the tool's observations. Each decision point becomes one row whose conversational
   `prompt` is the history up to that decision (so the prompt of decision `d + 1` is the prompt of decision `d` plus
   the action and observation in between);
2. trains a few GRPO steps of a tiny random Qwen3 model with the real Qwen3.6 tokenizer and chat template
   (`longstraw_trl.qwen_tokenizer`, no download) and the tool on (`tools=[read_page]`: a completion that calls it gets
   the observation appended and continues, as in TRL);
3. prints, per step, the prompt tokens prefilled (`longstraw/tokens_captured`) against those served from an existing
   state (`longstraw/tokens_reused`): the decision points of one trajectory sit in one generation batch (the dataset
   is not shuffled), the shortest history is captured and every later one is an extension of the previous one's
   state (only the new action + observation are prefilled).
"""
# ruff: noqa: E402 (the options are parsed before torch and transformers load, so --help answers at once)

from __future__ import annotations

import argparse
import json
import tempfile
import warnings

from _common import add_threads_option, quiet_logs, use_threads


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--trajectories", type=int, default=2, help="agent trajectories")
    parser.add_argument("--actions", type=int, default=2, help="tool actions per trajectory")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--num-generations", type=int, default=2, help="completions per decision point (G)")
    parser.add_argument("--max-completion-length", type=int, default=12, help="tokens per completion")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model init and the sampling")
    add_threads_option(parser)
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and wrong options end here, before the imports below (torch, transformers: seconds)

import torch
from datasets import Dataset
from transformers import Qwen3Config, Qwen3ForCausalLM

from longstraw_trl import LongStrawGRPOConfig, LongStrawGRPOTrainer
from longstraw_trl.qwen_tokenizer import QWEN3_6_VOCAB_SIZE, build_qwen3_6_tokenizer

PAGES = {f"p{i}": f"page {i} says the key of door {i} is {(7 * i + 3) % 10}" for i in range(10)}


def read_page(page: str) -> str:
    """Read one page of the manual.

    Args:
        page: The page name, e.g. "p3".
    """
    return PAGES.get(page, "no such page")


def trajectories(n: int, steps: int) -> list[list[dict]]:
    """`n` trajectories of `steps` read_page actions each: [system, user, (assistant tool call, tool result) * steps]."""
    out = []
    for t in range(n):
        door = t % len(PAGES)
        history = [
            {"role": "system", "content": "You are an agent. Use the tools to find keys."},
            {"role": "user", "content": f"Find the key of door {door}."},
        ]
        for s in range(steps):
            page = f"p{(door + s) % len(PAGES)}"
            history.append(
                {
                    "role": "assistant",
                    # with its reasoning: Qwen3.6 renders an empty one as "<think>\n\n</think>", whose "\n\n" token
                    # would not continue the "<think>\n" that ended this decision's prompt (no token prefix)
                    "reasoning_content": f"I should read {page}.",
                    "content": "",
                    "tool_calls": [
                        {"type": "function", "function": {"name": "read_page", "arguments": {"page": page}}}
                    ],
                }
            )
            history.append({"role": "tool", "name": "read_page", "content": read_page(page)})
        out.append(history)
    return out


def decision_points(trajectory: list[dict]) -> list[list[dict]]:
    """The prompt of every decision: the history up to (without) each assistant action, and after the last one."""
    cuts = [i for i, m in enumerate(trajectory) if m["role"] == "assistant"] + [len(trajectory)]
    return [trajectory[:i] for i in cuts]


def door_reward(completions, door, **kwargs):
    """1 if the completion names the key of its door, minus how far its length is from 40 characters (a random
    model rarely names the key: the length term gives the group different rewards from the first step)."""
    rewards = []
    for completion, d in zip(completions, door, strict=True):
        text = " ".join(str(m.get("content") or "") for m in completion)
        key = str((7 * d + 3) % 10)
        rewards.append(float(key in text) - abs(len(text) - 40) / 40)
    return rewards


def decision_dataset(n_trajectories: int, actions: int) -> Dataset:
    """One row per decision point: its conversational prompt and the trajectory's door."""
    rows = {"prompt": [], "door": []}
    for t, trajectory in enumerate(trajectories(n_trajectories, actions)):
        for prompt in decision_points(trajectory):
            rows["prompt"].append(prompt)
            rows["door"].append(t % len(PAGES))
    return Dataset.from_dict(rows)


def tiny_qwen3(tokenizer, seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=QWEN3_6_VOCAB_SIZE,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )


def build_trainer(args, model, tokenizer, dataset: Dataset) -> LongStrawGRPOTrainer:
    points = args.actions + 1  # decision points per trajectory: one generation batch per trajectory
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = LongStrawGRPOConfig(
            output_dir=tempfile.mkdtemp(prefix="agent_trajectories_"),
            report_to="none",
            use_cpu=True,
            bf16=False,
            seed=args.seed,
            max_steps=args.steps,
            learning_rate=1e-3,
            per_device_train_batch_size=args.num_generations * points,
            num_generations=args.num_generations,
            gradient_accumulation_steps=1,
            max_completion_length=args.max_completion_length,
            max_tool_calling_iterations=1,
            shuffle_dataset=False,  # a trajectory's decision points in one batch: each extends the previous state
            activation_checkpointing=False,
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
        )
        trainer = LongStrawGRPOTrainer(
            model=model,
            reward_funcs=door_reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            tools=[read_page],
        )
    quiet_logs(trainer)
    return trainer


def step_summary(log: dict) -> dict:
    """One logged step: its loss and reward, and the prompt tokens prefilled against those served from a state."""
    return {
        "step": log["step"],
        "loss": log["loss"],
        "reward": log["reward"],
        "tokens_captured": log["longstraw/tokens_captured"],
        "tokens_reused": log["longstraw/tokens_reused"],
        "captures": log["longstraw/refresh/capture"],
        "extends": log["longstraw/refresh/extend"],
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    use_threads(args.threads)
    dataset = decision_dataset(args.trajectories, args.actions)
    print(f"{len(dataset)} decision points from {args.trajectories} trajectories")
    tokenizer = build_qwen3_6_tokenizer()
    trainer = build_trainer(args, tiny_qwen3(tokenizer, args.seed), tokenizer, dataset)
    trainer.train()

    summary = {"steps": [step_summary(h) for h in trainer.state.log_history if "loss" in h]}
    for step in summary["steps"]:
        print(
            f"step {step['step']}: loss {step['loss']:+.4f} reward {step['reward']:.3f} | prompt tokens prefilled "
            f"{step['tokens_captured']:.0f}, reused {step['tokens_reused']:.0f} ({step['captures']:.0f} captures, "
            f"{step['extends']:.0f} extensions)"
        )
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
