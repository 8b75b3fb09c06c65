"""What every supported model family must do, one test body for all (Liger-Kernel's mini-model table style).

Each entry of ``MINI_MODELS`` is a tiny random-init model of one supported ``model_type`` (or a variant of one: a
sliding-window config, the vision-language wrapper); ``test_every_supported_model_type_has_a_mini_model`` fails when
a family is added to ``supported_model_types()`` without one. References are the stock HF model's own forward and
a capture of the concatenated prompt; the per-family test files keep only what is family-specific.
"""

from __future__ import annotations

import pytest
import torch
from _models import build, build_glm_dsa, build_hybrid, build_nemotron_h, build_window
from _reference import VOCAB, padded_completions, stock_logprobs
from _state import snapshot, unchanged

from longstraw_trl import (
    ConvRecurrentState,
    KVPages,
    capture_prompt,
    extend_state,
    generate_from_state,
    patch_model,
    replay_logprobs,
    supported_model_types,
)

SMALL_TOPK = 4  # GLM-5 / DeepSeek-V3.2: fewer keys than the prompt, so the selection matters

MINI_MODELS = {
    "llama": lambda: build("llama"),
    "qwen2": lambda: build("qwen2"),
    "qwen3": lambda: build("qwen3"),
    "qwen3_moe": lambda: build("qwen3_moe"),
    "glm4_moe": lambda: build("glm4_moe"),
    "qwen2_sliding": lambda: build_window("qwen2_sliding"),
    "qwen3_sliding": lambda: build_window("qwen3_sliding"),
    "qwen3_moe_sliding": lambda: build_window("qwen3_moe_sliding"),
    "mistral": lambda: build_window("mistral"),
    "ministral": lambda: build_window("ministral"),
    "cohere2": lambda: build_window("cohere2"),
    "gemma2": lambda: build_window("gemma2"),
    "gemma3_text": lambda: build_window("gemma3_text"),
    "gpt_oss": lambda: build_window("gpt_oss"),
    "qwen3_5_text": lambda: build_hybrid("qwen3_5"),
    "qwen3_5": lambda: build_hybrid("qwen3_5_vl"),
    "qwen3_5_moe_text": lambda: build_hybrid("qwen3_5_moe"),
    "qwen3_5_moe": lambda: build_hybrid("qwen3_5_moe_vl"),
    "qwen3_next": lambda: build_hybrid("qwen3_next"),
    "glm_moe_dsa": lambda: build_glm_dsa(index_topk=SMALL_TOPK),
    "deepseek_v32": lambda: build_glm_dsa(index_topk=SMALL_TOPK, family="deepseek_v32"),
    "nemotron_h": lambda: build_nemotron_h(),
}


def test_every_supported_model_type_has_a_mini_model():
    covered = {model.config.model_type for model in (make() for make in MINI_MODELS.values())}
    assert covered >= set(supported_model_types()), sorted(set(supported_model_types()) - covered)


@pytest.mark.parametrize("name", sorted(MINI_MODELS))
def test_state_is_read_only_under_replays_backward_and_generation(name):
    model = MINI_MODELS[name]()
    gen = torch.Generator().manual_seed(2)
    state = capture_prompt(model, torch.randint(0, VOCAB, (23,), generator=gen), chunk_size=8, page_size=4)
    snap = snapshot(state)
    comps, mask = padded_completions([7, 5, 3, 6], gen)
    for i in range(comps.shape[0]):
        n = int(mask[i].sum())
        replay_logprobs(state, model, comps[i : i + 1, :n], grad=True).sum().backward()
    replay_logprobs(state, model, comps, mask)  # and a graph-free batch
    generate_from_state(state, model, 2, 4, do_sample=False, pad_token_id=0)
    assert unchanged(snap)
    assert state.num_tokens == 23
    assert all(not t.requires_grad for t in snap[1])


@pytest.mark.parametrize("name", sorted(MINI_MODELS))
def test_extend_equals_capturing_the_concatenation(name):
    model = MINI_MODELS[name]()
    gen = torch.Generator().manual_seed(3)
    a = torch.randint(0, VOCAB, (21,), generator=gen)
    b = torch.randint(0, VOCAB, (13,), generator=gen)
    comps, mask = padded_completions([10, 4], gen)
    state_a = capture_prompt(model, a, chunk_size=8, page_size=8)
    snap = snapshot(state_a)
    extended = extend_state(state_a, model, b)
    whole = capture_prompt(model, torch.cat([a, b]), chunk_size=8, page_size=8)
    assert extended.num_tokens == whole.num_tokens == 34
    diff = (replay_logprobs(extended, model, comps, mask) - replay_logprobs(whole, model, comps, mask)) * mask
    assert diff.abs().max() <= 1e-5
    # the original state still scores its own prompt, unchanged
    assert unchanged(snap)
    ref = stock_logprobs(model, a, comps[:1, :10])
    assert (replay_logprobs(state_a, model, comps[:1, :10]) - ref).abs().max() <= 1e-4
    for i, layer in state_a.layers.items():
        if isinstance(layer, KVPages):  # the K/V is shared, not copied: the extension adds its own segment
            old, new = layer.segments, extended.layers[i].segments
            assert [k.data_ptr() for k, _, _ in new[: len(old)]] == [k.data_ptr() for k, _, _ in old]
        if isinstance(
            layer, ConvRecurrentState
        ):  # GDN, Mamba-2: replaced, not written into; equal to the whole capture's
            ext, full = extended.layers[i], whole.layers[i]
            assert ext.recurrent is not layer.recurrent
            assert torch.allclose(ext.recurrent, full.recurrent, atol=1e-6)
            assert torch.allclose(ext.conv, full.conv, atol=1e-6)


@pytest.mark.parametrize("name", sorted(MINI_MODELS))
def test_patch_is_idempotent_and_leaves_the_stock_forward_alone(name):
    model = MINI_MODELS[name]()
    ids = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        before = model(ids).logits
        assert patch_model(model) is model and patch_model(model) is model
        after = model(ids).logits
    assert torch.equal(before, after)
