"""The gradient's cosine at real length (the ``real-long`` suite's cosine part): for one GRPO group of the long-facts
task, with the advantages of its exact-answer rewards, the response-only gradient against the full one and both against
the stock model's full-sequence gradient, over all LoRA parameters and by module (q/k/v/o/MLP), with norm ratios.
bench/real_cosine.py's helpers, on the task's documents; rows are kept in ``<state>/cosine.json`` as they finish."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch
from real_cosine import compare, group_gradient, grpo_advantages, lora_model
from real_long_model import task

from longstraw_trl import capture_prompt, extend_state, generate_from_state


def sample_group(model, tokenizer, state, row: dict, opts, device):
    """G sampled completions of the row's question (at the training temperature), their exact-answer rewards."""
    q_ids = torch.tensor(task.question_ids(tokenizer, row["question"]), device=device)
    with torch.no_grad():
        full = extend_state(state, model, q_ids)
        ids = generate_from_state(full, model, opts.num_generations, opts.completion_tokens, temperature=opts.temperature,
                                  do_sample=True, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    texts = [tokenizer.decode(r, skip_special_tokens=True) for r in ids]
    rewards = torch.tensor(task.exact_reward(texts, [row["answer"]] * len(texts)))
    return full, ids, texts, rewards


def group_row(model, params, tokenizer, length: int, group: int, opts) -> dict:
    """One group at ``length`` tokens: a fresh document; questions tried in turn until one's rewards vary (up to
    ``opts.cosine_tries``); the three gradients and their comparisons."""
    device = next(model.parameters()).device
    spec = task.TaskSpec(doc_tokens=length - opts.completion_tokens - 32, questions_per_doc=opts.cosine_tries)
    rows = task.make_split(tokenizer, 1, spec, seed=random.Random(length * 1000 + group).randrange(2**31))
    t0 = time.perf_counter()
    doc = torch.tensor(task.document_ids(tokenizer, rows[0]["doc"]), device=device)
    with torch.no_grad():
        state = capture_prompt(model, doc, keep_boundaries=True)
    for row in rows:
        full, ids, texts, rewards = sample_group(model, tokenizer, state, row, opts, device)
        if rewards.std() > 0:
            break
    adv, kind = grpo_advantages(rewards)
    adv = adv.to(device)
    prompt = torch.cat([doc, torch.tensor(task.question_ids(tokenizer, row["question"]), device=device)])
    grads = {mode: group_gradient(model, params, full, ids, adv, mode, prompt, checkpointing=length > 4096)
             for mode in ("response_only", "full", "stock")}  # fmt: skip
    return {
        "length": length, "group": group, "prompt_tokens": prompt.numel(), "answer": row["answer"],
        "completions": texts, "rewards": rewards.tolist(), "advantages": kind,
        "response_only_vs_full": compare(grads["response_only"], grads["full"]),
        "response_only_vs_stock": compare(grads["response_only"], grads["stock"]),
        "full_vs_stock": compare(grads["full"], grads["stock"]),
        "seconds": time.perf_counter() - t0,
    }  # fmt: skip


def run_cosine(base, tokenizer, opts, state_dir: Path, deadline: float) -> list[dict]:
    """Every (length, group) not yet in ``<state>/cosine.json``, in order, until the deadline; returns all rows."""
    import copy

    path = state_dir / "cosine.json"
    rows = json.loads(path.read_text()) if path.is_file() else []
    done = {(r["length"], r["group"]) for r in rows}
    todo = [(n, g) for n in opts.cosine_lengths for g in range(opts.cosine_groups) if (n, g) not in done]
    if not todo:
        return rows
    model, params = lora_model(copy.deepcopy(base), rank=opts.lora_rank, seed=0)
    model.train()  # HF's activation checkpointing (the stock gradient at long lengths) runs in training mode only
    last, last_length = 0.0, None
    for length, group in todo:
        guess = 1.5 * last if length == last_length else 3.0 * last  # a longer prompt: about twice the time
        if time.monotonic() + max(guess, 20.0) > deadline:
            print(f"cosine: stopped before P={length} group {group} (budget)", flush=True)
            break
        torch.manual_seed(length * 1000 + group)
        row = group_row(model, params, tokenizer, length, group, opts)
        last, last_length = row["seconds"], length
        rows.append(row)
        path.write_text(json.dumps(rows, indent=1))
        c = row["response_only_vs_full"]
        print(f"cosine P={row['prompt_tokens']} group {group}: response-only vs full {c['cosine']:.3f} "
              f"(norm ratio {c['norm_ratio']:.3f}), vs stock {row['response_only_vs_stock']['cosine']:.3f}, "
              f"full vs stock {row['full_vs_stock']['cosine']:.4f}, {row['seconds']:.0f} s", flush=True)  # fmt: skip
    return rows


def cosine_table(rows: list[dict]) -> list[dict]:
    """Per length: the mean and range over groups of each cosine and norm ratio, and the per-module means."""
    out = []
    for length in sorted({r["length"] for r in rows}):
        group = [r for r in rows if r["length"] == length]
        entry = {"length": length, "groups": len(group), "prompt_tokens": group[0]["prompt_tokens"]}
        for key in ("response_only_vs_full", "response_only_vs_stock", "full_vs_stock"):
            cos = [r[key]["cosine"] for r in group]
            ratio = [r[key]["norm_ratio"] for r in group]
            modules = group[0][key]["modules"]
            entry[key] = {
                "cosine_mean": sum(cos) / len(cos), "cosine_min": min(cos), "cosine_max": max(cos),
                "norm_ratio_mean": sum(ratio) / len(ratio),
                "modules_cosine_mean": {m: sum(r[key]["modules"][m]["cosine"] for r in group) / len(group)
                                        for m in modules},
            }  # fmt: skip
        out.append(entry)
    return out
