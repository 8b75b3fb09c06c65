"""Engine on Gated DeltaNet hybrids (Qwen3.5 / Qwen3.6, Qwen3.5-MoE, Qwen3-Next) against the stock HF model.

fp32 on CPU. Every family has two GDN layers around one gated full-attention layer (``tests/_models.py``).
``qwen3_5_vl`` / ``qwen3_5_moe_vl`` are ``*ForConditionalGeneration`` models fed text only: the engine runs
their language model, the references run the whole stock model.
"""

from __future__ import annotations

import pytest
import torch
from _models import HYBRID_CONFIGS, build_hybrid
from _reference import (
    GRAD_VARIANTS,
    VOCAB,
    check_logprobs_against_stock,
    check_replay_grads,
)
from _state import assert_generate_matches_stock, snapshot, unchanged

from longstraw_trl import (
    GDNState,
    KVPages,
    LongStrawError,
    UnsupportedModelError,
    capture_prompt,
    patch_model,
    replay_logprobs,
)
from longstraw_trl.engine import ForwardContext, forward_model
from longstraw_trl.model_patches import (
    Qwen3_5Patch,
    Qwen3NextPatch,
    apply_longstraw_to_qwen3_5,
    apply_longstraw_to_qwen3_5_moe,
    apply_longstraw_to_qwen3_next,
    find_patch,
)

FAMILIES = list(HYBRID_CONFIGS)
CORE = ["qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "qwen3_next"]  # one of each HF code path


# ----------------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------------
LORA_TARGETS = [
    *("q_proj", "k_proj", "v_proj", "o_proj"),  # gated full attention
    *("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba", "out_proj"),  # GDN
    *("gate_proj", "up_proj", "down_proj"),  # MLP / shared expert
]


# ----------------------------------------------------------------------------------------------------
# Log-probs
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "prompt_len,chunk,page",
    [(1, 8, 4), (5, 16, 4), (37, 8, 5), (7, 2, 3), (130, 70, 32)],
    ids=["one-token", "shorter-than-chunk", "uneven", "chunk-shorter-than-conv", "crosses-kernel-chunks"],
)
def test_logprobs_match_stock_forward(family, prompt_len, chunk, page):
    state = check_logprobs_against_stock(build_hybrid(family), prompt_len, chunk, page)
    kinds = {i: type(layer) for i, layer in state.layers.items()}
    # a one-token prompt leaves nothing resident: its only token is replayed with each completion
    assert kinds == ({} if prompt_len == 1 else {0: GDNState, 1: KVPages, 2: GDNState})


# ----------------------------------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", CORE)
@pytest.mark.parametrize("variant", GRAD_VARIANTS)
def test_grads_match_response_only_reference(family, variant):
    got = check_replay_grads(build_hybrid(family), variant, LORA_TARGETS)
    if variant == "lora":
        assert all("lora_" in n for n in got)  # base weights are frozen
        assert any("linear_attn" in n for n in got) and any("self_attn" in n for n in got)
    else:
        gdn = {n.rsplit(".", 1)[-1] for n in got if "linear_attn" in n}
        assert {"A_log", "dt_bias", "weight"} <= gdn  # conv, norm, projections and the decay all learn


# ----------------------------------------------------------------------------------------------------
# State: read-only, extend, size
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_nbytes_by_kind_gdn_is_independent_of_prompt_length(family):
    model = build_hybrid(family)
    cfg = model.config.get_text_config()
    sizes = {}
    for p in (5, 61):
        state = capture_prompt(model, torch.randint(0, VOCAB, (p,)), chunk_size=16, page_size=10)
        sizes[p] = state.nbytes_by_kind()
        assert set(sizes[p]) == {"kv", "gdn"}
        assert state.nbytes() == sizes[p]["kv"] + sizes[p]["gdn"]
    n_full = cfg.layer_types.count("full_attention")
    n_gdn = cfg.layer_types.count("linear_attention")
    kv_per_token = 2 * n_full * cfg.num_key_value_heads * cfg.head_dim * 4
    # the layers hold P - 1 tokens: the last prompt token is replayed with every response
    assert sizes[5]["kv"] == 4 * kv_per_token and sizes[61]["kv"] == 60 * kv_per_token
    conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
    conv_dim += cfg.linear_num_value_heads * cfg.linear_value_head_dim
    per_layer = conv_dim * (cfg.linear_conv_kernel_dim - 1) * 4  # conv: last kernel - 1 inputs
    per_layer += cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    assert sizes[5]["gdn"] == sizes[61]["gdn"] == n_gdn * per_layer


# ----------------------------------------------------------------------------------------------------
# Decode mode (generation): token by token equals a replay of the same tokens
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", CORE)
def test_decode_token_by_token_equals_replay(family):
    model = build_hybrid(family)
    gen = torch.Generator().manual_seed(4)
    state = capture_prompt(model, torch.randint(0, VOCAB, (19,), generator=gen), chunk_size=8, page_size=8)
    snap = snapshot(state)
    tokens = torch.randint(0, VOCAB, (2, 6), generator=gen)
    start = state.resident_tokens
    with torch.no_grad():
        ctx = ForwardContext("decode", state, capacity=6)  # the response buffers, as generation sizes them
        steps = [forward_model(model, tokens[:, i : i + 1], start + i, ctx) for i in range(6)]
        decoded = torch.cat(steps, dim=1)
        replayed = forward_model(model, tokens, start, ForwardContext("replay", state))
    assert (decoded - replayed).abs().max().item() <= 1e-5
    gdn = [i for i, layer in state.layers.items() if isinstance(layer, GDNState)]
    assert sorted(i for i, r in ctx.running.items() if isinstance(r, GDNState)) == gdn
    assert all(ctx.running[i].recurrent.shape[0] == 2 for i in gdn)
    assert unchanged(snap)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_decode_logits_match_stock(family):
    model = build_hybrid(family)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, VOCAB, (17,), generator=gen)
    tokens = torch.randint(0, VOCAB, (2, 4), generator=gen)
    state = capture_prompt(model, prompt, chunk_size=8, page_size=8)
    ctx = ForwardContext("decode", state, capacity=5)
    # the state holds P - 1 tokens: decoding starts with the last prompt token
    fed = torch.cat([prompt[-1:].expand(2, 1), tokens], dim=1)
    with torch.no_grad():
        for i in range(5):
            logits = forward_model(model, fed[:, i : i + 1], state.resident_tokens + i, ctx, logits_to_keep=1)
        got = torch.log_softmax(logits[:, -1].float(), -1)
        full = torch.cat([prompt[None].expand(2, -1), tokens], dim=1)
        ref = torch.log_softmax(model(full).logits[:, -1].float(), -1)
    assert (got - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_vl", "qwen3_next"])
@pytest.mark.parametrize("sampling", [dict(do_sample=False), dict(do_sample=True, temperature=0.9, top_k=20)])
def test_generate_matches_stock_generate(family, sampling):
    """Shared-prefix generation on GDN states draws the same tokens as ``model.generate`` (same seed)."""
    model = build_hybrid(family)
    prompt = torch.randint(0, VOCAB, (21,), generator=torch.Generator().manual_seed(6))
    assert_generate_matches_stock(model, prompt, 8, 5, sampling)


# ----------------------------------------------------------------------------------------------------
# Patching
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", CORE)
def test_patch_is_idempotent_and_leaves_stock_forward_alone(family):
    model = build_hybrid(family)
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        before = model(ids).logits
        out = model(ids[:, :9], use_cache=True)  # cached path: prefill then single-token steps
        step = model(ids[:, 9:10], past_key_values=out.past_key_values, use_cache=True).logits
    assert patch_model(model) is model
    assert patch_model(model) is model
    gdn_cls = type(find_patch(model).gdn_modules(model)[0])
    wrapped = gdn_cls.forward
    patch_model(build_hybrid(family))  # a second model of the same class
    assert gdn_cls.forward is wrapped and wrapped._longstraw_gdn
    with torch.no_grad():
        after = model(ids).logits
        out = model(ids[:, :9], use_cache=True)
        step_after = model(ids[:, 9:10], past_key_values=out.past_key_values, use_cache=True).logits
    assert torch.equal(before, after)
    assert torch.equal(step, step_after)


def test_entry_points_and_registration():
    from longstraw_trl import supported_model_types

    assert {"qwen3_5", "qwen3_5_moe", "qwen3_next"} <= set(supported_model_types())
    assert isinstance(find_patch(build_hybrid("qwen3_5_vl")), Qwen3_5Patch)
    assert isinstance(find_patch(build_hybrid("qwen3_next")), Qwen3NextPatch)
    for family, entry in [
        ("qwen3_5", apply_longstraw_to_qwen3_5),
        ("qwen3_5_vl", apply_longstraw_to_qwen3_5),
        ("qwen3_5_moe", apply_longstraw_to_qwen3_5_moe),
        ("qwen3_next", apply_longstraw_to_qwen3_next),
    ]:
        model = build_hybrid(family)
        assert entry(model) is model
    with pytest.raises(UnsupportedModelError, match="model_type 'qwen3_5_text'.* not one of qwen3_next"):
        apply_longstraw_to_qwen3_next(build_hybrid("qwen3_5"))


def test_vl_decoder_is_the_language_model_and_positions_are_mrope_rows():
    model = build_hybrid("qwen3_5_vl")
    patch = find_patch(model)
    assert patch.decoder(model) is model.model.language_model
    pos = patch.position_ids(7, 3, 2, torch.device("cpu"))
    assert pos.shape == (3, 2, 3) and (pos == torch.arange(7, 10)).all()


def test_state_of_another_model_is_rejected():
    hybrid = build_hybrid("qwen3_5")
    other = build_hybrid("qwen3_next")
    state = capture_prompt(hybrid, torch.randint(0, VOCAB, (9,)), chunk_size=8, page_size=8)
    swapped = state.fork()
    swapped.layers[0], swapped.layers[1] = swapped.layers[1], swapped.layers[0]
    with pytest.raises(LongStrawError, match="another model"):
        replay_logprobs(swapped, other, torch.randint(0, VOCAB, (1, 4)))
    empty_gdn = state.fork()
    del empty_gdn.layers[2]
    with pytest.raises(LongStrawError, match="layer 2 has no captured GDNState"):
        replay_logprobs(empty_gdn, hybrid, torch.randint(0, VOCAB, (1, 4)))


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(attention_dropout=0.1), "attention_dropout"),
        (
            dict(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)),
            "rope_type='dynamic'",
        ),
        (
            dict(layer_types=["linear_attention", "sliding_attention", "linear_attention"]),
            "sliding_attention",
        ),
    ],
    ids=["conv-activation", "attention-dropout", "dynamic-rope", "layer-type"],
)
def test_unsupported_options_raise(change, match):
    model = build_hybrid("qwen3_5")
    for key, value in change.items():
        setattr(model.config, key, value)
    with pytest.raises(UnsupportedModelError, match=match):
        patch_model(model)
