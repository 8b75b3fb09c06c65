"""The model side of the ``real-long`` suite: loading (Gemma-3-270M, or a tiny random Gemma-3 for the CPU test), the
held-out greedy evaluation, and the check of our log-probs against the stock forward at the longest length."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import _long_facts as task  # noqa: E402

from longstraw_trl import capture_prompt, extend_state, generate_from_state, replay_logprobs  # noqa: E402

TINY = "tiny-gemma3"  # a 2-layer random Gemma-3 with the toy tokenizer: the suite's plumbing on a CPU
# the bounds of the GPU checks: fp32 log-probs against the stock forward (tests/test_engine_gqa.py), bf16 ones against
# the stock bf16 forward (the engine suite's small check, tests/test_bench_scripts.py); at 32K tokens the bf16 one is
# taken against the fp32 forward, beside the stock bf16 forward's own distance to it (logprob_check)
LOGPROB_BOUNDS = {"fp32": 1e-4, "bf16": 5e-2}


def tiny_gemma3(vocab: int = 128):
    """A 2-layer Gemma-3 (a window layer of 16 tokens, then a global one) and the toy character tokenizer."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from longstraw_trl.toy_tokenizer import build_toy_tokenizer

    config = Gemma3TextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, sliding_window=16, max_position_embeddings=4096, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
    )  # fmt: skip
    torch.manual_seed(0)
    return Gemma3ForCausalLM(config), build_toy_tokenizer(vocab)


def load(name: str, device: str):
    """``(model, tokenizer)`` in fp32 on ``device``, SDPA attention (``name``: a packaged model or :data:`TINY`)."""
    if name == TINY:
        model, tokenizer = tiny_gemma3()
    else:
        from longstraw_trl.pretrained import load_pretrained

        model, tokenizer = load_pretrained(name, attn_implementation="sdpa")
    return model.to(device), tokenizer


def _ids(ids: list[int], device) -> torch.Tensor:
    return torch.tensor(ids, device=device)


@torch.no_grad()
def greedy_eval(model, tokenizer, rows: list[dict], completion_tokens: int) -> dict:
    """Held-out exact accuracy of greedy answers: each document captured once, each question an ``extend`` of it."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    exact, state, doc_id = [], None, None
    for row in rows:
        if row["doc_id"] != doc_id:
            state, doc_id = (
                capture_prompt(model, _ids(task.document_ids(tokenizer, row["doc"]), device)),
                row["doc_id"],
            )
        q_ids = _ids(task.question_ids(tokenizer, row["question"]), device)
        out = generate_from_state(
            extend_state(state, model, q_ids), model, 1, completion_tokens, do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        exact.append(
            float(task.answer_of(tokenizer.decode(out[0], skip_special_tokens=True)) == row["answer"])
        )
    model.train(was_training)
    return accuracy(exact)


def accuracy(exact: list[float]) -> dict:
    """Share of exact answers, its binomial standard error, and the per-question outcomes."""
    acc = statistics.fmean(exact) if exact else float("nan")
    n = len(exact)
    return {"accuracy": acc, "accuracy_stderr": math.sqrt(acc * (1 - acc) / n) if n else float("nan"),
            "questions": n, "per_question": exact}  # fmt: skip


def stock_logprobs(model, prompt: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
    """log p(completion | prompt) from the stock model's forward over the whole sequence (last logits only)."""
    full = torch.cat([prompt, completion])[None]
    logits = model(full, logits_to_keep=completion.numel() + 1).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, completion[:, None])[:, 0]


@torch.no_grad()
def logprob_check(model, tokenizer, length: int, dtype: str, completions: int = 2, tokens: int = 8) -> dict:
    """Our log-probs of ``completions`` random completions of a ``length``-token task document + question against the
    stock forward's, in ``dtype``: ``fp32``, or ``bf16`` autocast over the fp32 weights (how TRL's ``bf16=True`` runs
    them, and the training runs here).

    fp32: within the GPU tests' bound of the stock forward. bf16: both sides round differently (their attention
    kernels sum in other orders), so ours is checked against the fp32 stock forward: no further from it than the
    stock bf16 forward is, plus the bf16 bound; the distance to the stock bf16 forward is recorded beside it."""
    import contextlib
    import random

    device = next(model.parameters()).device
    model.eval()
    spec = task.TaskSpec(doc_tokens=length - tokens - 32)
    row = task.make_split(tokenizer, 1, spec, seed=7)[0]
    prompt = _ids(
        task.document_ids(tokenizer, row["doc"]) + task.question_ids(tokenizer, row["question"]), device
    )
    gen = torch.Generator().manual_seed(random.Random(length).randrange(2**31))
    vocab = min(len(tokenizer), model.config.vocab_size)
    comps = torch.randint(0, vocab, (completions, tokens), generator=gen).to(device)
    likely = task.question_ids(
        tokenizer, f" {row['answer']}.\n{row['question']}"
    )  # the answer, then more text
    comps[0] = _ids(likely[:tokens], device)
    exact = [stock_logprobs(model, prompt, c) for c in comps]
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()
    )
    with autocast:
        state = capture_prompt(model, prompt)
        ours = replay_logprobs(state, model, comps).float()
        stock = [stock_logprobs(model, prompt, c) for c in comps] if dtype == "bf16" else exact
    del state

    def worst(a, b) -> float:
        return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))

    bound, to_stock = LOGPROB_BOUNDS[dtype], worst(ours, stock)
    record = {
        "dtype": dtype,
        "prompt_tokens": prompt.numel(),
        "max_abs_logprob_diff": to_stock,
        "bound": bound,
    }
    if dtype == "fp32":
        return {**record, "within_bound": to_stock <= bound}
    ours_err, stock_err = worst(ours, exact), worst(stock, exact)
    return {**record, "ours_vs_fp32": ours_err, "stock_bf16_vs_fp32": stock_err,
            "within_bound": ours_err <= stock_err + bound}  # fmt: skip
