"""GRPO on a real pretrained model: SmolLM2-135M-Instruct learns to read one value out of a long list (`make demo`).

    python examples/grpo_lockers.py                  # CPU defaults: about 10 minutes on a 2-core machine
    python examples/grpo_lockers.py --steps 60 --eval-docs 4

The task. Each document is a system message of office notes, ~1,250 tokens: 40 facts "The locker number of <Name> is
<4 digits>." each followed by a filler sentence. A question asks for one person's locker number and starts the
assistant's answer ("The locker number of Lena is"), so the completion is the number. The model starts imperfect (it
often copies a neighbouring number, or drops / changes a digit); the reward is the fraction of the four digits it gets
right in place (1 for the exact number), the held-out score the share of exact answers over questions on documents
never trained on.

What LongStraw does here: a document is captured once (its per-layer K/V) and every question on it *extends* that
state by its ~25 tokens (the trainer's prompt-state cache; the question rows of one document come one after another,
and a callback captures the bare document at the start of the steps that use it); the G completions of a question are
sampled from that state and replayed on it under autograd with LoRA. Held-out evaluation does the same with the engine
API (``capture_prompt`` once per document, ``extend`` per question, greedy ``generate``). It prints prompt tokens
captured against reused.

Dtype: fp32 with ``bf16=False``. TRL's default ``bf16=True`` turns on CPU autocast, which rounds the forward and
the gradient to bf16 and, on this CPU (no native bf16), ran SmolLM2's forward 3.8x to 11x slower than fp32
(``bench/cpu_autocast.py``); the model is small, so fp32 costs nothing in memory. Threads: one by default on a machine
of two cores or fewer, because there two intra-op threads ran the capture and decoding about 2x slower than one
(thread wake-ups; measure with ``--threads 2``).
"""
# ruff: noqa: E402 (the options are parsed before torch and transformers load, so --help answers at once)

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time
import warnings

from _common import (
    add_threads_option,
    mean_of,
    paired_gain,
    peak_memory_gib,
    quiet_logs,
    reward_window,
    save_run,
    show_step_progress,
    state_bytes_per_prompt,
    step_logs,
    use_threads,
)

FIRST_NAMES = (
    "Alice Bruno Chen Dana Elif Farid Greta Hiro Ines Jonas Kemal Lena Mateo Nadia Oskar Priya Quinn Rosa Sven Tariq "
    "Uma Viktor Wanda Xavier Yara Zane Amir Bea Cyrus Dmitri Esme Felix Gia Hugo Ivy Jude Kai Luca Mira Nico Omar Pia "
    "Ravi Sana Theo Ugo Vera Wes Yuki Zoe"
).split()
FILLER = (
    "The weather was mild and the office stayed quiet for most of the afternoon.",
    "Deliveries arrive on Tuesdays and are sorted by the front desk before noon.",
    "The cafeteria menu changes every week and usually includes a vegetarian dish.",
    "Cleaning staff visit the building in the evening after most people have left.",
    "The elevators were serviced last month and now run more smoothly than before.",
)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    task = ap.add_argument_group("task")
    task.add_argument("--model", default="smollm2-135m-instruct", help="a longstraw_trl.pretrained model")
    task.add_argument("--facts", type=int, default=40, help="facts per document")
    task.add_argument("--filler", type=int, default=1, help="filler sentences after each fact")
    task.add_argument("--questions-per-doc", type=int, default=8, help="training questions per document")
    task.add_argument("--eval-docs", type=int, default=3, help="held-out documents")
    task.add_argument("--eval-questions", type=int, default=16, help="held-out questions per document")
    train = ap.add_argument_group("training")
    train.add_argument("--steps", type=int, default=24, help="optimizer steps")
    train.add_argument("--num-generations", type=int, default=8, help="completions per question (G)")
    train.add_argument(
        "--questions-per-step", type=int, default=2, help="questions (groups) per optimizer step"
    )
    train.add_argument("--completion-tokens", type=int, default=6, help="max_completion_length")
    train.add_argument("--learning-rate", type=float, default=5e-4, help="AdamW learning rate (LoRA)")
    train.add_argument("--lora-rank", type=int, default=16, help="LoRA rank on every linear layer")
    train.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    train.add_argument(
        "--gradient-mode",
        choices=["response_only", "full"],
        default="response_only",
        help="LongStrawGRPOConfig",
    )
    train.add_argument(
        "--refresh-interval",
        type=int,
        default=0,
        help="0: re-capture a document after every optimizer step (exact); N: reuse its state for N steps",
    )
    train.add_argument(
        "--no-activation-checkpointing",
        action="store_true",
        help="turn off TRL's activation checkpointing (on by default)",
    )
    add_threads_option(train)
    train.add_argument("--seed", type=int, default=0, help="seed of the data, the LoRA init and the sampling")
    out = ap.add_argument_group("output")
    out.add_argument(
        "--output-dir", default="outputs/grpo_lockers", help="adapter, log_history.json, summary.json"
    )
    return ap.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and wrong options end here, before the imports below (torch, transformers: seconds)

import torch
from datasets import Dataset
from tqdm.auto import tqdm
from transformers import TrainerCallback

from longstraw_trl import (
    LongStrawGRPOConfig,
    LongStrawGRPOTrainer,
    capture_prompt,
    extend_state,
    generate_from_state,
)
from longstraw_trl.pretrained import load_pretrained


# ----------------------------------------------------------------------------------------------------------------------
# Task
# ----------------------------------------------------------------------------------------------------------------------
def make_document(rng: random.Random, facts: int, filler: int) -> tuple[str, dict[str, str]]:
    names = rng.sample(FIRST_NAMES, facts)
    table = {name: str(rng.randrange(1000, 10000)) for name in names}
    lines = []
    for name, value in table.items():
        lines.append(f"The locker number of {name} is {value}.")
        lines += [rng.choice(FILLER) for _ in range(filler)]
    text = "<|im_start|>system\nYou are a helpful assistant. Here are the office notes.\n" + "\n".join(lines)
    return text + "<|im_end|>\n", table


def question(name: str) -> str:
    return (
        f"<|im_start|>user\nWhat is the locker number of {name}?<|im_end|>\n"
        f"<|im_start|>assistant\nThe locker number of {name} is"
    )


def make_split(n_docs: int, questions: int, args, seed: int) -> list[dict]:
    """``n_docs`` documents, ``questions`` distinct names asked on each; rows of one document are consecutive."""
    rng = random.Random(seed)
    rows = []
    for d in range(n_docs):
        doc, table = make_document(rng, args.facts, args.filler)
        for name in rng.sample(sorted(table), questions):
            rows.append({"doc": doc, "doc_id": d, "question": question(name), "answer": table[name]})
    return rows


def answer_of(completion: str) -> str:
    text = completion.strip()
    return text.split()[0].rstrip(".") if text else ""


def digit_score(completion: str, answer: str) -> float:
    got = answer_of(completion)
    if got == answer:
        return 1.0
    return sum(a == b for a, b in zip(got, answer, strict=False)) / len(answer) * 0.5


def locker_reward(completions, answer, **kwargs) -> list[float]:
    """1 for the exact number; otherwise half the share of its digits right in place."""
    return [digit_score(c, a) for c, a in zip(completions, answer, strict=True)]


# ----------------------------------------------------------------------------------------------------------------------
# Evaluation and the document warm-up
# ----------------------------------------------------------------------------------------------------------------------
def token_ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])


@torch.no_grad()
def greedy_eval(model, tokenizer, rows: list[dict], completion_tokens: int, desc: str) -> dict:
    """Greedy answers: each document captured once, each question an ``extend`` of its state."""
    was_training = model.training
    model.eval()
    exact, scores, captured, reused, state, doc_id = [], [], 0, 0, None, None
    for row in tqdm(rows, desc=desc, unit="q", dynamic_ncols=True):
        if row["doc_id"] != doc_id:
            doc_ids = token_ids(tokenizer, row["doc"])
            state, doc_id = capture_prompt(model, doc_ids), row["doc_id"]
            captured += doc_ids.numel()
        q_ids = token_ids(tokenizer, row["question"])
        out = generate_from_state(
            extend_state(state, model, q_ids),
            model,
            1,
            completion_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        text = tokenizer.decode(out[0], skip_special_tokens=True)
        exact.append(float(answer_of(text) == row["answer"]))
        scores.append(digit_score(text, row["answer"]))
        captured += q_ids.numel()
        reused += doc_ids.numel()
    model.train(was_training)
    n = len(exact)
    acc = statistics.fmean(exact)
    return {
        "accuracy": acc,
        "accuracy_stderr": math.sqrt(acc * (1 - acc) / n),
        "reward": statistics.fmean(scores),
        "questions": n,
        "per_question": exact,
        "prompt_tokens_captured": captured,
        "prompt_tokens_reused": reused,
    }


class WarmDocuments(TrainerCallback):
    """Captures the bare document of the coming step's questions into the trainer's prompt-state cache, so each
    question extends it (the cache re-captures it when the refresh policy finds it stale)."""

    def __init__(self, trainer, rows: list[dict], rows_per_step: int):
        self.trainer, self.rows, self.per_step = trainer, rows, rows_per_step
        self.tokenizer = trainer.processing_class

    def on_step_begin(self, args, state, control, **kwargs):
        start = state.global_step * self.per_step
        docs = {r["doc"] for r in self.rows[start : start + self.per_step]}
        for doc in docs:
            self.trainer.prompt_cache.get(token_ids(self.tokenizer, doc), state.global_step)


def grpo_arguments(args) -> dict:
    """The GRPOConfig keywords of a run (shared with a stock ``trl.GRPOConfig``: bench/real_modes.py)."""
    return dict(
        output_dir=args.output_dir,
        report_to="none",
        use_cpu=True,
        bf16=False,  # fp32: see the module docstring
        seed=args.seed,
        shuffle_dataset=False,  # the questions of one document in consecutive steps
        per_device_train_batch_size=args.num_generations * args.questions_per_step,
        num_generations=args.num_generations,
        gradient_accumulation_steps=1,
        max_completion_length=args.completion_tokens,
        temperature=args.temperature,
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        loss_type="dapo",
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        activation_checkpointing=not args.no_activation_checkpointing,
    )


def lora_config(args):
    """LoRA of rank ``--lora-rank`` on every linear layer."""
    from peft import LoraConfig

    return LoraConfig(
        r=args.lora_rank,
        lora_alpha=2 * args.lora_rank,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )


def train_dataset(rows: list[dict]) -> Dataset:
    return Dataset.from_list([{"prompt": r["doc"] + r["question"], "answer": r["answer"]} for r in rows])


def build_trainer(args, model, tokenizer, train_rows: list[dict], progress: bool = False):
    """The LongStraw trainer of a run (``progress``: a bar over the steps; otherwise nothing printed per step)."""
    policy = "recapture" if args.refresh_interval == 0 else "reuse"
    config = LongStrawGRPOConfig(
        **grpo_arguments(args),
        gradient_mode=args.gradient_mode,
        refresh_policy=policy,
        **({"refresh_interval": args.refresh_interval} if policy == "reuse" else {}),
    )
    trainer = LongStrawGRPOTrainer(
        model=model,
        reward_funcs=locker_reward,
        args=config,
        train_dataset=train_dataset(train_rows),
        processing_class=tokenizer,
        peft_config=lora_config(args),
    )
    if progress:
        show_step_progress(trainer)
    else:
        quiet_logs(trainer)
    trainer.add_callback(WarmDocuments(trainer, train_rows, args.questions_per_step))
    return trainer


# ----------------------------------------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------------------------------------
def summarize(args, trainer, doc_tokens: int, before: dict, after: dict, train_seconds: float) -> dict:
    logs = step_logs(trainer)
    window = reward_window(logs, most=6)
    gain, gain_se = paired_gain(after["per_question"], before["per_question"])

    def total_of(key):
        return int(sum(r.get(key) or 0 for r in logs))

    return {
        "model": args.model,
        "args": vars(args),
        "document_tokens": doc_tokens,
        "train_seconds": train_seconds,
        "reward_window": window,
        "train_reward_first_steps": mean_of("reward", logs[:window]),
        "train_reward_last_steps": mean_of("reward", logs[-window:]),
        "reward_curve": [r["reward"] for r in logs],
        "heldout_before": {k: v for k, v in before.items() if k != "per_question"},
        "heldout_after": {k: v for k, v in after.items() if k != "per_question"},
        "heldout_accuracy_gain": gain,
        "heldout_accuracy_gain_stderr": gain_se,
        "train_prompt_tokens_captured": total_of("longstraw/tokens_captured"),
        "train_prompt_tokens_reused": total_of("longstraw/tokens_reused"),
        "state_bytes_per_prompt": state_bytes_per_prompt(logs),
        "peak_memory_gib": peak_memory_gib(logs),
        "peak_memory_kind": "process peak RSS",
        # wall clock over the whole training (generation, document captures and logging included)
        "seconds_per_step": train_seconds / max(len(logs), 1),
        # TRL's step_time: its training_step alone
        "trl_step_time": mean_of("step_time", logs),
    }


def print_summary(summary: dict, output_dir: str) -> None:
    window, before, after = summary["reward_window"], summary["heldout_before"], summary["heldout_after"]
    kinds = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in summary["state_bytes_per_prompt"].items())
    print(
        "\nsummary\n"
        f"  training reward      {summary['train_reward_first_steps']:.3f} (first {window} steps) -> "
        f"{summary['train_reward_last_steps']:.3f} (last {window} steps)\n"
        f"  held-out exact       {before['accuracy']:.1%} ± {before['accuracy_stderr']:.1%} -> "
        f"{after['accuracy']:.1%} ± {after['accuracy_stderr']:.1%} ({after['questions']} questions; paired gain "
        f"{summary['heldout_accuracy_gain']:+.1%} ± {summary['heldout_accuracy_gain_stderr']:.1%})\n"
        f"  held-out reward      {before['reward']:.3f} -> {after['reward']:.3f}\n"
        f"  prompt tokens        training: {summary['train_prompt_tokens_captured']:,} captured, "
        f"{summary['train_prompt_tokens_reused']:,} reused; each evaluation: {after['prompt_tokens_captured']:,} "
        f"captured, {after['prompt_tokens_reused']:,} reused\n"
        f"  prompt state         {kinds} per prompt\n"
        f"  peak memory          {summary['peak_memory_gib']:.2f} GiB ({summary['peak_memory_kind']})\n"
        f"  time                 {summary['train_seconds']:.0f} s training ({summary['seconds_per_step']:.1f} s/step), "
        f"{summary['total_seconds']:.0f} s in all\n"
        f"  saved                LoRA adapter, log_history.json, summary.json in {output_dir}/"
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    use_threads(args.threads)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    model, tokenizer = load_pretrained(args.model)
    print(
        f"model: {args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, fp32, CPU)"
    )

    n_train_docs = math.ceil(args.steps * args.questions_per_step / args.questions_per_doc)
    train_rows = make_split(n_train_docs, args.questions_per_doc, args, seed=1000 + args.seed)
    held_out = make_split(args.eval_docs, args.eval_questions, args, seed=10**6)  # the same for every seed
    doc_tokens = token_ids(tokenizer, train_rows[0]["doc"]).numel()
    print(
        f"task: {args.facts} facts/document ({doc_tokens} tokens), {n_train_docs} training documents x "
        f"{args.questions_per_doc} questions, held out: {args.eval_docs} documents x {args.eval_questions} questions; "
        f"G={args.num_generations}, {args.questions_per_step} questions/step, {args.steps} steps, "
        f"gradient_mode={args.gradient_mode}"
    )
    before = greedy_eval(model, tokenizer, held_out, args.completion_tokens, "held-out before")
    print(f"held-out before: exact {before['accuracy']:.1%} ± {before['accuracy_stderr']:.1%}")

    trainer = build_trainer(args, model, tokenizer, train_rows, progress=True)
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start
    after = greedy_eval(trainer.model, tokenizer, held_out, args.completion_tokens, "held-out after")
    summary = summarize(args, trainer, doc_tokens, before, after, train_seconds)
    summary["total_seconds"] = time.perf_counter() - t0
    trainer.save_model(args.output_dir)
    save_run(trainer, args.output_dir, summary)
    print_summary(summary, args.output_dir)
    return summary


if __name__ == "__main__":
    main()
