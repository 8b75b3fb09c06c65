"""GRPO on a needle-in-a-haystack task with LongStrawGRPOTrainer, on a random-init model (no download).

    python examples/grpo_needle.py                          # CPU defaults: a few minutes
    python examples/grpo_needle.py --prompt-tokens 131072   # on a GPU: scale the haystack

What it does:
1. builds a small random-init Qwen3.5-architecture model (Gated DeltaNet layers + one gated full-attention layer;
   falls back to Qwen3 if this install has no `qwen3_5` patch) and the local character-level tokenizer;
2. makes a dataset with `datasets`: each prompt is a haystack of random letters of `--prompt-tokens` tokens with the
   needle `key=D` (a digit) hidden at a random place, followed by the question `key?`;
3. trains with `LongStrawGRPOTrainer`: every prompt is captured once per group, the `--num-generations` completions are
   sampled from its state and the loss is back-propagated one response at a time;
4. prints a summary: reward before and after (training curve and a held-out greedy evaluation against chance), the
   prompt-state bytes by kind and the peak memory, and saves the model, the tokenizer, the logs and the summary under
   `--output-dir` (default `outputs/grpo_needle`, gitignored).

Reward: 1 if the first digit of the completion is the needle, 0.2 if it is another digit, 0 without a digit (the
0.2 teaches the answer format first). A random-init model learns the format within the CPU default budget; reading
the needle out of the haystack takes longer (more steps, a larger model, `--needle-copies` > 1 makes it easier).
`make demo` runs examples/grpo_lockers.py, the same trainer on a real pretrained model.
"""
# ruff: noqa: E402 (the options are parsed before torch and transformers load, so --help answers at once)

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import sys
import time
import warnings

from _common import (
    add_threads_option,
    fmt_bytes,
    mean_of,
    peak_memory_gib,
    reward_window,
    save_run,
    show_step_progress,
    state_bytes_per_prompt,
    step_logs,
    use_threads,
)

LETTERS = "abcdefghijklmnopqrstuvwxyz"
DIGITS = "0123456789"
QUESTION = "\nkey?"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    data = ap.add_argument_group("task")
    data.add_argument(
        "--prompt-tokens", type=int, default=1024, help="tokens per prompt (haystack + needle + question)"
    )
    data.add_argument(
        "--needle-copies", type=int, default=1, help="times the needle `key=D` is hidden in a haystack"
    )
    data.add_argument("--train-prompts", type=int, default=512, help="distinct training prompts")
    data.add_argument(
        "--eval-prompts", type=int, default=32, help="held-out prompts for the before/after evaluation"
    )
    model = ap.add_argument_group("model")
    model.add_argument(
        "--model-type",
        choices=["auto", "qwen3_5", "qwen3"],
        default="auto",
        help="architecture of the random-init model; auto: qwen3_5 when supported",
    )
    model.add_argument("--hidden-size", type=int, default=64, help="hidden size of the random-init model")
    model.add_argument(
        "--layers", type=int, default=4, help="decoder layers (qwen3_5: every 4th is full attention)"
    )
    train = ap.add_argument_group("training")
    train.add_argument("--steps", type=int, default=120, help="optimizer steps")
    train.add_argument("--num-generations", type=int, default=8, help="completions per prompt (G)")
    train.add_argument("--prompts-per-step", type=int, default=2, help="prompt groups per optimizer step")
    train.add_argument("--completion-tokens", type=int, default=4, help="max_completion_length")
    train.add_argument("--learning-rate", type=float, default=3e-3, help="constant AdamW learning rate")
    train.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    train.add_argument("--loss-type", default="dapo", help="TRL loss_type")
    train.add_argument(
        "--beta",
        type=float,
        default=0.0,
        help="KL coefficient; != 0: the initial weights are saved to OUTPUT_DIR/initial_model as TRL's reference "
        "model, and each group gets a reference capture",
    )
    train.add_argument(
        "--refresh-policy",
        choices=["recapture", "reuse", "adaptive"],
        default="recapture",
        help="see LongStrawGRPOConfig",
    )
    train.add_argument(
        "--cp-size",
        type=int,
        default=1,
        help="context-parallel ranks per prompt; launch with examples/accelerate/cp<N>.yaml",
    )
    train.add_argument("--chunk-size", type=int, default=8192, help="capture_chunk_size")
    train.add_argument("--page-size", type=int, default=16384, help="page_size")
    train.add_argument("--offload", choices=["none", "cpu"], default="none", help="offload_prompt_state")
    train.add_argument(
        "--bf16", choices=["auto", "yes", "no"], default="auto", help="bf16 mixed precision (auto: CUDA)"
    )
    add_threads_option(train)
    train.add_argument(
        "--seed", type=int, default=0, help="seed of the model init, the data and the sampling"
    )
    out = ap.add_argument_group("output")
    out.add_argument(
        "--output-dir", default="outputs/grpo_needle", help="model, tokenizer, log_history.json, summary.json"
    )
    out.add_argument(
        "--report-to",
        default="none",
        help="TrainingArguments.report_to (tensorboard: pip install longstraw-trl[tensorboard]; wandb, trackio: "
        "their own packages)",
    )
    return ap.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and wrong options end here, before the imports below (torch, transformers: seconds)

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from longstraw_trl import (
    LongStrawGRPOConfig,
    LongStrawGRPOTrainer,
    capture_prompt,
    generate_from_state,
    supported_model_types,
)
from longstraw_trl.toy_tokenizer import build_toy_tokenizer


# ----------------------------------------------------------------------------------------------------------------------
# Task
# ----------------------------------------------------------------------------------------------------------------------
def make_prompt(rng: random.Random, tokens: int, copies: int) -> tuple[str, str]:
    digit = rng.choice(DIGITS)
    needle = f" key={digit} "
    hay_len = tokens - len(QUESTION) - copies * len(needle)
    if hay_len < 1:
        raise SystemExit(f"--prompt-tokens {tokens} is too short for {copies} needle(s)")
    hay = [rng.choice(LETTERS) for _ in range(hay_len)]
    for pos in sorted((rng.randrange(hay_len + 1) for _ in range(copies)), reverse=True):
        hay.insert(pos, needle)
    return "".join(hay) + QUESTION, digit


def make_dataset(n: int, tokens: int, copies: int, seed: int) -> Dataset:
    rng = random.Random(seed)
    rows = [make_prompt(rng, tokens, copies) for _ in range(n)]
    return Dataset.from_dict({"prompt": [p for p, _ in rows], "answer": [a for _, a in rows]})


def first_digit(text: str) -> str | None:
    return next((c for c in text if c.isdigit()), None)


def needle_reward(completions, answer, **kwargs) -> list[float]:
    """1 if the first digit of the completion is the needle, 0.2 for another digit, 0 without a digit."""
    rewards = []
    for completion, digit in zip(completions, answer, strict=True):
        found = first_digit(completion)
        rewards.append(0.0 if found is None else 1.0 if found == digit else 0.2)
    return rewards


# ----------------------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------------------
def build_model(args, vocab_size: int, main_process: bool = True):
    model_type = args.model_type
    if model_type == "auto":
        model_type = "qwen3_5" if "qwen3_5" in supported_model_types() else "qwen3"
        if model_type == "qwen3" and main_process:
            print("note: this install has no qwen3_5 patch; using a Qwen3 model instead", file=sys.stderr)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=max(args.hidden_size // 4, 8),
        max_position_embeddings=args.prompt_tokens + args.completion_tokens + 8,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    if model_type == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        layer_types = [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(args.layers)
        ]
        if "full_attention" not in layer_types:
            layer_types[-1] = "full_attention"
        config = Qwen3_5TextConfig(
            **common,
            layer_types=layer_types,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            rope_parameters=dict(
                rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25, mrope_section=[1, 1, 0]
            ),
        )
    else:
        from transformers import Qwen3Config

        config = Qwen3Config(**common)
    return AutoModelForCausalLM.from_config(config).float(), model_type


def with_reference_weights(model, config: LongStrawGRPOConfig, path: str):
    """The model, loaded back from ``path`` where its initial weights are saved, so the KL term has a reference.

    With ``beta != 0`` and no PEFT adapters, TRL's ``GRPOTrainer`` (which ``LongStrawGRPOTrainer`` extends; it takes no
    ``ref_model``) builds the reference model with ``from_pretrained(model.config._name_or_path)``. A random-init
    model has an empty ``_name_or_path``: saving its initial weights and loading the policy from there gives TRL a
    path whose weights are the policy's at step 0, which is GRPO's reference. Each host's first process writes them,
    the others wait and read them.
    """
    with config.main_process_first(desc="saving the initial weights for the reference model"):
        if config.distributed_state is None or config.distributed_state.is_local_main_process:
            model.save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def greedy_eval(model, tokenizer, dataset: Dataset, completion_tokens: int) -> dict[str, float]:
    """Greedy answer of every held-out prompt, decoded from its captured state."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    rewards, hits = [], 0
    for row in dataset:
        ids = torch.tensor(tokenizer(row["prompt"])["input_ids"], device=device)
        state = capture_prompt(model, ids)
        out = generate_from_state(
            state,
            model,
            1,
            completion_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        text = tokenizer.decode(out[0], skip_special_tokens=True)
        rewards.append(needle_reward([text], [row["answer"]])[0])
        hits += first_digit(text) == row["answer"]
        del state
    model.train(was_training)
    return {"reward": statistics.fmean(rewards), "accuracy": hits / len(dataset)}


# ----------------------------------------------------------------------------------------------------------------------
# Training run
# ----------------------------------------------------------------------------------------------------------------------
def make_config(args, cuda: bool) -> LongStrawGRPOConfig:
    bf16 = {"auto": cuda and torch.cuda.is_bf16_supported(), "yes": True, "no": False}[args.bf16]
    return LongStrawGRPOConfig(
        output_dir=args.output_dir,
        report_to=args.report_to,
        use_cpu=not cuda,
        bf16=bf16,
        seed=args.seed,
        per_device_train_batch_size=args.num_generations * args.prompts_per_step,
        num_generations=args.num_generations,
        gradient_accumulation_steps=1,
        max_completion_length=args.completion_tokens,
        temperature=args.temperature,
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        loss_type=args.loss_type,
        beta=args.beta,
        logging_steps=1,
        save_strategy="no",
        # TRL's default (layers recomputed in backward) under transformers' name: the deprecated
        # `gradient_checkpointing` default of TRL's config warns otherwise
        activation_checkpointing=True,
        capture_chunk_size=args.chunk_size,
        page_size=args.page_size,
        offload_prompt_state=None if args.offload == "none" else args.offload,
        refresh_policy=args.refresh_policy,
        cp_size=args.cp_size,
    )


def summarize(
    args, trainer, model_type: str, before: dict, after: dict, train_seconds: float, cuda: bool
) -> dict:
    logs = step_logs(trainer)
    window = reward_window(logs, most=10)
    return {
        "model_type": model_type,
        "prompt_tokens": args.prompt_tokens,
        "steps": args.steps,
        "train_seconds": train_seconds,
        "reward_window": window,
        "train_reward_first_steps": mean_of("reward", logs[:window]),
        "train_reward_last_steps": mean_of("reward", logs[-window:]),
        "heldout_greedy_before": before,
        "heldout_greedy_after": after,
        "chance_accuracy": 1 / len(DIGITS),
        "state_bytes_per_prompt": state_bytes_per_prompt(logs),
        "peak_memory_gib": peak_memory_gib(logs),
        "peak_memory_kind": "cuda max allocated" if cuda else "process peak RSS",
        "seconds_per_step": {
            "capture": mean_of("longstraw/capture_seconds", logs),
            "generation": mean_of("longstraw/generation_seconds", logs),
            "policy_replay_and_backward": mean_of("longstraw/replay_seconds", logs),
            "step": mean_of("step_time", logs),
        },
    }


def print_summary(summary: dict, output_dir: str) -> None:
    window, before, after = (
        summary["reward_window"],
        summary["heldout_greedy_before"],
        summary["heldout_greedy_after"],
    )
    kinds = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in summary["state_bytes_per_prompt"].items())
    seconds = summary["seconds_per_step"]
    print(
        "\nsummary\n"
        f"  training reward      {summary['train_reward_first_steps']:.3f} (first {window} steps) -> "
        f"{summary['train_reward_last_steps']:.3f} (last {window} steps)\n"
        f"  held-out greedy      reward {before['reward']:.3f} -> {after['reward']:.3f}, needle found "
        f"{before['accuracy']:.0%} -> {after['accuracy']:.0%} (chance {summary['chance_accuracy']:.0%})\n"
        f"  prompt state         {kinds} per {summary['prompt_tokens']}-token prompt\n"
        f"  peak memory          {summary['peak_memory_gib']:.2f} GiB ({summary['peak_memory_kind']})\n"
        f"  time                 {summary['train_seconds']:.0f} s training, per step: capture "
        f"{seconds['capture']:.3f} s/prompt, generation {seconds['generation']:.3f} s, replay+backward "
        f"{seconds['policy_replay_and_backward']:.3f} s\n"
        f"  saved                model, tokenizer, log_history.json, summary.json in {output_dir}/"
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    if "tensorboard" in args.report_to and importlib.util.find_spec("tensorboard") is None:
        raise SystemExit(
            "--report-to tensorboard needs the tensorboard package: pip install longstraw-trl[tensorboard]"
        )
    use_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    cuda = torch.cuda.is_available()

    tokenizer = build_toy_tokenizer(64)
    train = make_dataset(args.train_prompts, args.prompt_tokens, args.needle_copies, args.seed)
    held_out = make_dataset(args.eval_prompts, args.prompt_tokens, args.needle_copies, args.seed + 1)
    os.makedirs(args.output_dir, exist_ok=True)
    config = make_config(args, cuda)
    if config.process_index != 0:  # transformers' bars (loading, saving weights) on the first process only
        hf_logging.disable_progress_bar()
    model, model_type = build_model(args, len(tokenizer), main_process=config.process_index == 0)
    if args.beta != 0.0:
        model = with_reference_weights(model, config, os.path.join(args.output_dir, "initial_model"))
    trainer = LongStrawGRPOTrainer(
        model=model,
        reward_funcs=needle_reward,
        args=config,
        train_dataset=train,
        processing_class=tokenizer,
    )
    show_step_progress(trainer)

    n_params = sum(p.numel() for p in model.parameters())
    print_once = print if trainer.accelerator.is_main_process else lambda *a, **k: None
    print_once(
        f"model: random-init {model_type}, {args.layers} layers, hidden {args.hidden_size}, {n_params / 1e6:.2f}M "
        f"parameters on {'cuda' if cuda else 'cpu'}; task: {args.prompt_tokens}-token prompts, needle `key=D` "
        f"hidden {args.needle_copies}x, G={args.num_generations}, {args.prompts_per_step} prompts/step, "
        f"{args.steps} steps"
    )
    before = greedy_eval(trainer.model, tokenizer, held_out, args.completion_tokens)
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start
    after = greedy_eval(trainer.model, tokenizer, held_out, args.completion_tokens)
    summary = summarize(args, trainer, model_type, before, after, train_seconds, cuda)
    trainer.save_model(args.output_dir)
    if trainer.accelerator.is_main_process:  # one summary per run, also under a multi-process launch
        save_run(trainer, args.output_dir, summary)
        print_summary(summary, args.output_dir)
    return summary


if __name__ == "__main__":
    main()
