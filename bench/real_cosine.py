"""Cosine between the response-only and the full-sequence gradient on a real model, over prompt lengths (CPU, fp32).

    python bench/real_cosine.py --lengths 512 1024 2048 4096 --out bench/results/real_cosine_smollm2_cpu.json

For each length: a locker-notes document of that many tokens (examples/grpo_lockers.py's task) and a question; G
completions sampled from the captured state (temperature 1); GRPO advantages from the task's reward (reward minus the
group mean, over the group's standard deviation); the DAPO-weighted sum of the completions' log-probs is
back-propagated (LoRA r=16 on every linear layer, B initialised randomly so that every LoRA factor has a gradient)
twice on the same state: replays only (the response-only objective, the default) and replays + ``prompt_backward``
(``gradient_mode="full"``, equal to the stock full-sequence gradient: tests/test_pretrained.py). Prints and saves the
cosine and the norms of the two gradients.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from grpo_lockers import FILLER, FIRST_NAMES, digit_score, question, token_ids  # noqa: E402

from longstraw_trl import capture_prompt, generate_from_state, replay_logprobs  # noqa: E402
from longstraw_trl.engine import StateGrads, prompt_backward  # noqa: E402
from longstraw_trl.pretrained import load_pretrained  # noqa: E402


def document_of_length(tokenizer, rng: random.Random, length: int) -> tuple[str, dict[str, str]]:
    """Locker notes grown fact by fact (names may repeat with a suffix) until ``length`` tokens."""
    head = "<|im_start|>system\nYou are a helpful assistant. Here are the office notes.\n"
    lines, table, i = [], {}, 0
    while True:
        name = FIRST_NAMES[i % len(FIRST_NAMES)] + (
            "" if i < len(FIRST_NAMES) else f" {i // len(FIRST_NAMES)}"
        )
        value = str(rng.randrange(1000, 10000))
        trial = lines + [f"The locker number of {name} is {value}.", rng.choice(FILLER)]
        if token_ids(tokenizer, head + "\n".join(trial) + "<|im_end|>\n").numel() > length:
            break
        lines, table[name] = trial, value
        i += 1
    return head + "\n".join(lines) + "<|im_end|>\n", table


TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODULES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "mlp", "up_proj": "mlp",
           "down_proj": "mlp"}  # fmt: skip


def lora_model(base, rank: int = 16, seed: int = 0):
    """LoRA of rank ``rank`` on every linear layer, B initialised randomly and small (every factor has a gradient,
    the model stays close to the pretrained one); returns the model and its trainable parameters by name."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.01)
    return model, {n: p for n, p in model.named_parameters() if p.requires_grad}


def module_of(name: str) -> str:
    """``q`` / ``k`` / ``v`` / ``o`` / ``mlp`` (or ``other``) of a parameter's name."""
    return next((m for t, m in MODULES.items() if f".{t}." in name), "other")


def stock_logprobs(model, prompt: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
    """The stock full-sequence log-probs of ``completion`` after ``prompt`` (autograd through the whole sequence)."""
    logits = model(torch.cat([prompt, completion])[None], logits_to_keep=completion.numel() + 1).logits
    return torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, completion[:, None])[:, 0]


def group_gradient(model, params: dict, state, ids, adv, mode: str, prompt=None, checkpointing: bool = False):
    """The DAPO-weighted gradient of one group (``sum_i adv_i sum_t log p / tokens``) as one flat vector per
    parameter: ``response_only`` (replays), ``full`` (replays + ``prompt_backward``) or ``stock`` (the stock model's
    forward over prompt + completion; ``checkpointing``: HF's activation checkpointing for it)."""
    model.zero_grad(set_to_none=True)
    n_tokens = ids.numel()
    sg = StateGrads(state) if mode == "full" else None
    if mode == "stock" and checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        for i in range(ids.shape[0]):
            if mode == "stock":
                lp = stock_logprobs(model, prompt, ids[i])
            else:
                lp = replay_logprobs(
                    state, model, ids[i : i + 1], grad=True, **({"grads": sg} if sg else {})
                )[0]
            (lp.float().sum() * adv[i] / n_tokens).backward()
        if mode == "full":
            prompt_backward(state, model, sg)
    finally:
        if mode == "stock" and checkpointing:
            model.gradient_checkpointing_disable()
    return {n: p.grad.detach().float().flatten().clone() for n, p in params.items()}


def compare(a: dict, b: dict) -> dict:
    """Cosine and norm ratio |a| / |b| of two gradients, over all parameters and by module (q/k/v/o/mlp)."""

    def pair(names):
        x, y = torch.cat([a[n] for n in names]).double(), torch.cat([b[n] for n in names]).double()
        cos = torch.nn.functional.cosine_similarity(x, y, dim=0).item()
        return {"cosine": cos, "norm_ratio": (x.norm() / y.norm()).item()}

    modules = sorted({module_of(n) for n in a})
    return {**pair(list(a)), "modules": {m: pair([n for n in a if module_of(n) == m]) for m in modules}}


def grpo_advantages(rewards: torch.Tensor) -> tuple[torch.Tensor, str]:
    """GRPO advantages (reward minus the group mean, over its standard deviation); a group without reward variance
    has none: centred ranks instead (and says so)."""
    adv = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    if adv.abs().max() == 0:
        return torch.linspace(-1, 1, len(rewards)), "ranks (equal rewards)"
    return adv, "grpo"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8128])
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--completion-tokens", type=int, default=6)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/real_cosine_smollm2_cpu.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    base, tokenizer = load_pretrained(args.model)
    model, params = lora_model(base, seed=args.seed)
    rows = []
    for length in args.lengths:
        rng = random.Random(args.seed * 7919 + length)
        doc, table = document_of_length(tokenizer, rng, length)
        name = rng.choice(sorted(table))
        prompt = torch.cat([token_ids(tokenizer, doc), token_ids(tokenizer, question(name))])
        t0 = time.perf_counter()
        with torch.no_grad():
            state = capture_prompt(
                model, prompt, chunk_size=args.chunk, page_size=args.chunk, keep_boundaries=True
            )
            ids = generate_from_state(
                state, model, args.generations, args.completion_tokens, temperature=1.0, do_sample=True
            )
        texts = [tokenizer.decode(r, skip_special_tokens=True) for r in ids]
        rewards = torch.tensor([digit_score(t, table[name]) for t in texts])
        adv, advantages = grpo_advantages(rewards)
        grads = {
            mode: group_gradient(model, params, state, ids, adv, mode) for mode in ("response_only", "full")
        }
        both = compare(grads["response_only"], grads["full"])
        row = {
            "prompt_tokens": prompt.numel(),
            "cosine": both["cosine"],
            "modules": both["modules"],
            "norm_response_only": torch.cat(list(grads["response_only"].values())).norm().item(),
            "norm_full": torch.cat(list(grads["full"].values())).norm().item(),
            "rewards": rewards.tolist(),
            "advantages": advantages,
            "completions": texts,
            "answer": table[name],
            "seconds": time.perf_counter() - t0,
        }
        rows.append(row)
        print(
            f"P={row['prompt_tokens']:>5}: cosine {row['cosine']:.3f}, |g_ro| {row['norm_response_only']:.3e}, "
            f"|g_full| {row['norm_full']:.3e}, rewards {row['rewards']} ({advantages}), {row['seconds']:.0f} s",
            flush=True,
        )
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:  # after every length: a long run keeps what it measured
            json.dump({"model": args.model, "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
