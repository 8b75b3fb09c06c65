"""Sliding-window, soft-capped and sink attention families against the stock HF model (fp32, CPU).

Every prompt is longer than the window (8) unless a case says otherwise, and responses are longer than it,
so the window state, the banded mask against the prompt's window and the band within the response all
decide the results; the references are the stock full forward, the stock cache (response-only
gradients) and stock ``model.generate``.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from _models import WINDOW, WINDOW_CONFIGS, build_window
from _reference import (
    GRAD_VARIANTS,
    VOCAB,
    assert_grads_close,
    check_replay_grads,
    engine_grads,
    padded_completions,
    response_only_reference,
    stock_logprobs,
    weighted_replay_grads,
)
from _spawn import exit_worker, run_processes
from _state import assert_generate_matches_stock

from longstraw_trl import (
    KVPages,
    UnsupportedModelError,
    WindowKV,
    capture_prompt,
    generate_from_state,
    patch_model,
    replay_logprobs,
)
from longstraw_trl.engine import ForwardContext, forward_model
from longstraw_trl.planner import plan_memory, state_bytes

FAMILIES = list(WINDOW_CONFIGS)
LORA_TARGETS = {
    "gpt_oss": ["q_proj", "k_proj", "v_proj", "o_proj"],  # its experts are parameters, not Linear layers
}
DEFAULT_LORA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _check_against_stock(model, prompt_len: int, chunk: int, page: int, lengths=(20, 9, 1)):
    gen = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen)
    comps, mask = padded_completions(list(lengths), gen)
    state = capture_prompt(model, prompt, chunk_size=chunk, page_size=page)
    got = replay_logprobs(state, model, comps, mask)
    for i, n in enumerate(mask.sum(1).tolist()):
        ref = stock_logprobs(model, prompt, comps[i : i + 1, :n])
        assert (got[i : i + 1, :n] - ref).abs().max().item() <= 1e-4
    return state


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "prompt_len,chunk,page",
    [(1, 8, 4), (5, 16, 4), (9, 4, 4), (45, 8, 6), (70, 16, 16), (41, 64, 7)],
    ids=["one-token", "shorter-than-window", "window-plus-one", "uneven", "aligned", "one-chunk"],
)
def test_logprobs_match_stock_forward(family, prompt_len, chunk, page):
    """Responses of 20 > window tokens, 9 and 1; chunks shorter and longer than the window."""
    state = _check_against_stock(build_window(family), prompt_len, chunk, page)
    windows = [layer for layer in state.layers.values() if isinstance(layer, WindowKV)]
    assert prompt_len == 1 or windows  # a one-token prompt holds no layer state
    assert all(w.stored_tokens() == min(prompt_len - 1, WINDOW - 1) for w in windows)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("variant", GRAD_VARIANTS)
def test_grads_match_response_only_reference(family, variant):
    """Prompt 29, response 11 (both past the window) against the stock sliding-window cache."""
    got = check_replay_grads(build_window(family), variant, LORA_TARGETS.get(family, DEFAULT_LORA))
    if variant == "lora":
        assert all("lora_" in n for n in got)
    if family == "gpt_oss" and variant == "full":
        sinks = [n for n in got if n.endswith(".sinks")]
        assert len(sinks) == 3 and all(got[n].norm() > 0 for n in sinks)  # sliding and full layers


def test_sink_gradient_matches_reference_alone():
    """Only the sinks train: their gradient on its own against the stock cache (sliding and full layers)."""
    model = build_window("gpt_oss")
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith(".sinks"))
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, VOCAB, (37,), generator=gen)
    completion = torch.randint(0, VOCAB, (13,), generator=gen)
    weights = torch.randn(13, generator=gen)
    state = capture_prompt(model, prompt, chunk_size=8, page_size=8)
    got = engine_grads(model, state, completion, weights)
    assert sorted(got) == [f"model.layers.{i}.self_attn.sinks" for i in range(3)]
    assert_grads_close(got, response_only_reference(model, prompt, completion, weights))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "sampling",
    [dict(do_sample=False), dict(do_sample=True, temperature=0.9, top_k=20)],
    ids=["greedy", "sample"],
)
def test_generate_matches_stock_generate(family, sampling):
    """20 new tokens (past the window of 8) on a 33-token prompt: the same tokens as ``model.generate``."""
    model = build_window(family)
    prompt = torch.randint(0, VOCAB, (33,), generator=torch.Generator().manual_seed(6))
    ids = assert_generate_matches_stock(model, prompt, 8, 5, sampling, new_tokens=20)
    assert ids.shape[1] > WINDOW


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_decode_with_growing_buffers_equals_replay(family):
    """Decode without fixed shapes (buffers grow past the announced capacity) equals a replay, past the window."""
    model = build_window(family)
    state = capture_prompt(model, torch.randint(0, VOCAB, (23,)), chunk_size=8)
    toks = torch.randint(0, VOCAB, (2, 13))
    start = state.resident_tokens
    with torch.no_grad():
        full = forward_model(model, toks, start, ForwardContext("replay", state))
        ctx = ForwardContext("decode", state, capacity=2)
        steps = [forward_model(model, toks[:, i : i + 1], start + i, ctx)[:, -1] for i in range(13)]
    assert (torch.stack(steps, 1) - full).abs().max() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_window_state_bytes_stop_growing_and_match_the_planner(family):
    model = build_window(family)
    cfg = model.config
    sizes = {}
    for p in (4, 9, 40, 70):
        state = capture_prompt(model, torch.randint(0, VOCAB, (p,)), chunk_size=16, page_size=8)
        sizes[p] = state.nbytes_by_kind()
        assert state_bytes(cfg, p, 1, 8, dtype_bytes=4) == sizes[p]
        # the whole plan uses the same formula (2-byte states: the plan's dtype)
        assert plan_memory(cfg, p, page_size=8).state_by_kind == state_bytes(cfg, p, 1, 8)
        assert state.slack_bytes() == 0
    per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    n_window = sum(t == "sliding_attention" for t in find_types(cfg))
    assert sizes[4]["kv_window"] == n_window * 3 * per_token  # P - 1 = 3 tokens, under the window
    assert sizes[9]["kv_window"] == sizes[40]["kv_window"] == sizes[70]["kv_window"]
    assert sizes[70]["kv_window"] == n_window * (WINDOW - 1) * per_token
    if "kv" in sizes[70]:  # full layers still hold every resident token
        n_full = len(find_types(cfg)) - n_window
        assert sizes[70]["kv"] == n_full * 69 * per_token


def find_types(cfg):
    from longstraw_trl.model_patches import patch_for_model_type

    return patch_for_model_type(cfg.model_type).layer_types(cfg)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_offload_equals_resident(family):
    """Offloaded full-layer K/V is streamed by page; the window state stays on the compute device."""
    model = build_window(family)
    prompt = torch.randint(0, VOCAB, (40,))
    comps = torch.randint(0, VOCAB, (2, 12))
    a = capture_prompt(model, prompt, chunk_size=8, page_size=8)
    b = capture_prompt(model, prompt, chunk_size=8, page_size=8, offload_prompt_state="cpu")
    assert (replay_logprobs(a, model, comps) - replay_logprobs(b, model, comps)).abs().max() <= 1e-5
    streamed = {
        i: [k.shape[1] for k, _ in layer.stream(torch.device("cpu"))] for i, layer in b.layers.items()
    }
    assert streamed == {0: [7], 1: [8, 8, 8, 8, 7], 2: [7]}  # windows whole, full K/V in pages of 8
    mask = torch.ones_like(comps)
    g_a, g_b = weighted_replay_grads(model, a, comps, mask), weighted_replay_grads(model, b, comps, mask)
    assert (g_a - g_b).norm() / g_a.norm() <= 1e-5


# ----------------------------------------------------------------------------------------------------
# Context parallelism: full-layer pages sharded, windows held whole on every rank
# ----------------------------------------------------------------------------------------------------
def _cp_worker(rank: int, world: int, init_file: str, family: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        model = build_window(family)
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, VOCAB, (45,), generator=gen)
        ids = torch.randint(0, VOCAB, (3, 12), generator=gen)
        mask = torch.tensor([[1] * 12, [1] * 9 + [0] * 3, [1] * 2 + [0] * 10])
        single = capture_prompt(model, prompt, chunk_size=8, page_size=4)
        sharded = capture_prompt(model, prompt, chunk_size=8, page_size=4, cp_group=dist.group.WORLD)
        # windows: whole on every rank; full-layer K/V: this rank's pages only (summing to one process's)
        for i, layer in sharded.layers.items():
            if isinstance(layer, WindowKV):  # (after a full layer: up to the CP merge's rounding)
                torch.testing.assert_close(layer.k, single.layers[i].k, rtol=0, atol=1e-5)
                torch.testing.assert_close(layer.v, single.layers[i].v, rtol=0, atol=1e-5)
                every = [torch.empty_like(layer.k) for _ in range(world)]
                dist.all_gather(every, layer.k.contiguous())
                assert all(torch.equal(every[0], k) for k in every)  # the same window on every rank
            else:
                assert isinstance(layer, KVPages) and 0 < layer.nbytes() < single.layers[i].nbytes()
        kv = torch.tensor([sharded.nbytes_by_kind()["kv"]])
        dist.all_reduce(kv)
        assert int(kv) == single.nbytes_by_kind()["kv"]
        diff = (replay_logprobs(single, model, ids, mask) - replay_logprobs(sharded, model, ids, mask)) * mask
        assert diff.abs().max() <= 1e-5, diff.abs().max()
        g_single, g_cp = (
            weighted_replay_grads(model, single, ids, mask),
            weighted_replay_grads(model, sharded, ids, mask),
        )
        assert (g_cp - g_single).norm() / g_single.norm() <= 1e-5
        gathered = [torch.empty_like(g_cp) for _ in range(world)]
        dist.all_gather(gathered, g_cp)
        assert all(torch.equal(gathered[0], g) for g in gathered)
        a = generate_from_state(single, model, 2, 12, do_sample=False)
        b = generate_from_state(sharded, model, 2, 12, do_sample=False)
        assert torch.equal(a, b)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_worker()


@pytest.mark.parametrize("family", ["gpt_oss", "gemma2"])
def test_context_parallel_equals_single_process(family):
    """gpt_oss: windows, full layers and sinks (the sink merges after the pages' all-gather); gemma2: soft-capped
    page partials."""
    with tempfile.TemporaryDirectory() as tmp:
        run_processes(_cp_worker, (2, os.path.join(tmp, "init"), family), 2)


# ----------------------------------------------------------------------------------------------------
# Patching and refusals
# ----------------------------------------------------------------------------------------------------
def test_gemma3_ignores_attn_logit_softcapping_like_hf():
    """HF's Gemma 3 attention does not pass ``attn_logit_softcapping`` to the attention interface, so the stock
    model ignores it; the engine (which reads the interface's keywords) does too."""
    model = build_window("gemma3_text", attn_logit_softcapping=0.05)
    _check_against_stock(model, 30, 8, 8)


@pytest.mark.parametrize(
    "family,change,match",
    [
        ("gemma2", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        ("cohere2", dict(attention_dropout=0.1), "attention_dropout"),
        ("ministral", dict(layer_types=["chunked_attention"] * 3), "chunked_attention"),
        (
            "mistral",
            dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
            "dynamic",
        ),
        (
            "gemma3_text",
            dict(
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                    "full_attention": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
                }
            ),
            "dynamic",
        ),
    ],
)
def test_refuses_what_it_cannot_reproduce(family, change, match):
    model = build_window(family)
    for key, value in change.items():
        setattr(model.config, key, value)
    with pytest.raises(UnsupportedModelError, match=match):
        patch_model(model)


# ----------------------------------------------------------------------------------------------------
# Through the trainer: old / reference log-probs (window layers, soft-caps) equal the stock forward
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_trainer_logprobs_equal_stock_forward(family):
    from _trl_helpers import TINY_VOCAB, make_tiny_longstraw_trainer
    from peft import LoraConfig

    # (gpt_oss: the router's load-balancing loss is refused by the trainer, as for every MoE family)
    ids = dict(vocab_size=TINY_VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = build_window(family, router_aux_loss_coef=0.0, **ids)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = make_tiny_longstraw_trainer(
        model=model, peft_config=lora, beta=0.04, num_iterations=2, temperature=0.9, max_completion_length=12
    )
    with torch.no_grad():  # as if the policy adapter had been trained
        for name, param in trainer.model.named_parameters():
            if "lora_B.default" in name:
                param.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    trainer.model.train()
    torch.manual_seed(0)
    prompt_text = "the quick brown fox jumps over the lazy dog " * 2  # longer than the window
    out = trainer._generate_and_score_completions([{"prompt": prompt_text}] * 4)
    prompt = out["longstraw_prompts"][0][1]
    assert prompt.numel() > WINDOW
    ids, mask = out["completion_ids"], out["completion_mask"]
    full = torch.cat([prompt[None].expand(ids.size(0), -1), ids], dim=1)

    def stock_logps():
        with torch.no_grad():
            logits = trainer.model(full).logits.float() / 0.9
        logp = torch.log_softmax(logits[:, prompt.numel() - 1 : -1], -1)
        return logp.gather(-1, ids[..., None])[..., 0] * mask

    policy = stock_logps()
    with trainer.model.disable_adapter():
        reference = stock_logps()
    assert (policy - reference).abs().max() > 1e-2
    assert (out["old_per_token_logps"] - policy).abs().max() <= 1e-4
    assert (out["ref_per_token_logps"] - reference).abs().max() <= 1e-4


@pytest.mark.parametrize("family", ["gemma2", "cohere2"])
def test_entropies_see_the_post_processed_logits(family):
    """The head request's entropies come from the same soft-capped / scaled logits as the stock model's."""
    model = build_window(family)
    gen = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, VOCAB, (30,), generator=gen)
    comps = torch.randint(0, VOCAB, (2, 10), generator=gen)
    state = capture_prompt(model, prompt, chunk_size=8)
    logp, entropy = replay_logprobs(state, model, comps, temperature=0.7, return_entropy=True)
    with torch.no_grad():
        logits = model(torch.cat([prompt[None].expand(2, -1), comps], 1)).logits[:, 29:-1].float() / 0.7
    ref = torch.log_softmax(logits, -1)
    assert (logp - ref.gather(-1, comps[..., None])[..., 0]).abs().max() <= 1e-4
    assert (entropy - -(ref.exp() * ref).sum(-1)).abs().max() <= 1e-4


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_cpu_bf16_autocast(family):
    """TRL's default ``bf16=True`` on CPU: window, soft-cap and sink paths run under autocast, close to fp32, and
    the window state keeps one dtype for K and V."""
    model = build_window(family)
    gen = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, VOCAB, (40,), generator=gen)
    comps = torch.randint(0, VOCAB, (2, 12), generator=gen)
    ref = replay_logprobs(capture_prompt(model, prompt, chunk_size=8), model, comps)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = capture_prompt(model, prompt, chunk_size=8)
        got = replay_logprobs(state, model, comps, grad=True)
        got.sum().backward()
    assert (got - ref).abs().max() <= 5e-2
    assert all(
        p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad
    )
    windows = [layer for layer in state.layers.values() if isinstance(layer, WindowKV)]
    assert all(w.k.dtype == w.v.dtype for w in windows)


def test_entry_points_and_registration():
    from longstraw_trl import supported_model_types
    from longstraw_trl.model_patches import (
        Cohere2Patch,
        Gemma2Patch,
        Gemma3TextPatch,
        GptOssPatch,
        MistralPatch,
        apply_longstraw_to_cohere2,
        apply_longstraw_to_gemma2,
        apply_longstraw_to_gemma3,
        apply_longstraw_to_gpt_oss,
        apply_longstraw_to_mistral,
        find_patch,
    )

    entries = {
        "mistral": (MistralPatch, apply_longstraw_to_mistral),
        "ministral": (MistralPatch, apply_longstraw_to_mistral),
        "cohere2": (Cohere2Patch, apply_longstraw_to_cohere2),
        "gemma2": (Gemma2Patch, apply_longstraw_to_gemma2),
        "gemma3_text": (Gemma3TextPatch, apply_longstraw_to_gemma3),
        "gpt_oss": (GptOssPatch, apply_longstraw_to_gpt_oss),
    }
    assert set(entries) <= set(supported_model_types())
    for family, (patch_type, entry) in entries.items():
        model = build_window(family)
        assert type(find_patch(model)) is patch_type
        assert entry(model) is model
    with pytest.raises(UnsupportedModelError, match="gemma2.*patch_model"):
        apply_longstraw_to_gemma2(build_window("gpt_oss"))
