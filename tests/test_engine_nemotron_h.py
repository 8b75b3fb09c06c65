"""Engine on Nemotron-H (``nemotron_h``: Mamba-2 + attention + MLP + MoE blocks) against the stock HF model.

fp32 on CPU, the tiny model of ``tests/_models.py`` (``M * - M E``: two Mamba-2 blocks, one attention block, an MLP
and an MoE block; SSD chunks of 16 tokens). References are the stock unpatched model: its full forward on prompt +
completion, its own cache for the response-only gradient, its full forward + backward for the full gradient, its
``generate``, and stock TRL ``GRPOTrainer`` for a training step. Prompts of a few hundred tokens are captured in chunks
that do not divide them, so the conv history and the SSM state cross every kind of boundary (capture chunk, SSD chunk
inside a capture chunk, a capture chunk shorter than the conv).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from _models import build_nemotron_h, nemotron_h_config
from _reference import (
    GRAD_VARIANTS,
    VOCAB,
    assert_grads_close,
    check_logprobs_against_stock,
    check_replay_grads,
    engine_full_grads,
    padded_completions,
    param_grads,
    stock_full_grads,
    stock_logprobs,
    weighted_replay_grads,
)
from _spawn import exit_worker, run_processes
from _state import assert_generate_matches_stock, snapshot, unchanged
from _trl_helpers import TINY_VOCAB, assert_updates_match, train_stock_and_full

from longstraw_trl import (
    KVPages,
    LongStrawError,
    Mamba2State,
    UnsupportedModelError,
    capture_prompt,
    extend_state,
    generate_from_state,
    patch_model,
    replay_logprobs,
)
from longstraw_trl.engine import ForwardContext, forward_model
from longstraw_trl.model_patches import NemotronHPatch, apply_longstraw_to_nemotron_h, find_patch
from longstraw_trl.planner import full_gradient_bytes, plan_memory, state_bytes

# peft refuses LoRA on a Mamba model's ``out_proj`` and ``conv1d`` (HF's fused kernel reads their weights directly)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "up_proj", "down_proj"]
MAMBA_LAYERS, ATTENTION_LAYERS = [0, 3], [1]
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # the toy tokenizer's


def _data(seed: int = 1, prompt_len: int = 21, g: int = 2, r: int = 6):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen)
    comps = torch.randint(0, VOCAB, (g, r), generator=gen)
    return prompt, comps, torch.randn(g, r, generator=gen)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item()


# ----------------------------------------------------------------------------------------------------
# Log-probs
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prompt_len,chunk,page",
    [(1, 8, 4), (5, 16, 4), (7, 2, 3), (301, 64, 32), (257, 37, 16)],
    ids=["one-token", "shorter-than-chunk", "chunk-shorter-than-conv", "301-by-64", "257-by-37"],
)
def test_logprobs_match_stock_forward(prompt_len, chunk, page):
    state = check_logprobs_against_stock(build_nemotron_h(), prompt_len, chunk, page)
    kinds = {i: type(layer) for i, layer in state.layers.items()}
    # a one-token prompt leaves nothing resident; MLP / MoE blocks keep no state
    assert kinds == ({} if prompt_len == 1 else {0: Mamba2State, 1: KVPages, 3: Mamba2State})


def test_the_prompt_state_decides_the_logprobs():
    """The captured Mamba-2 state matters: zeroing either part of it (conv history, SSM state) moves the log-probs."""
    model = build_nemotron_h()
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (97,), generator=gen)
    comps = torch.randint(0, VOCAB, (2, 8), generator=gen)
    state = capture_prompt(model, prompt, chunk_size=24, page_size=16)
    ref = stock_logprobs(model, prompt, comps)
    assert (replay_logprobs(state, model, comps) - ref).abs().max() <= 1e-4
    for part in ("conv", "recurrent"):
        broken = state.fork()
        for i in MAMBA_LAYERS:
            layer = broken.layers[i]
            setattr(layer, part, torch.zeros_like(getattr(layer, part)))
        assert (replay_logprobs(broken, model, comps) - ref).abs().max() > 1e-3, part


# ----------------------------------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", GRAD_VARIANTS)
def test_grads_match_response_only_reference(variant):
    got = check_replay_grads(build_nemotron_h(), variant, LORA_TARGETS)
    if variant == "lora":
        assert all("lora_" in n for n in got)
        assert any("mixer.in_proj" in n for n in got) and any("mixer.q_proj" in n for n in got)
    else:
        mamba = {n.rsplit(".", 1)[-1] for n in got if "layers.0.mixer" in n}
        assert {
            "A_log",
            "dt_bias",
            "D",
            "weight",
            "bias",
        } <= mamba  # conv, norm, projections and the SSM all learn


@pytest.mark.parametrize("block_size", [None, 2], ids=["replay", "reverse-block-replay"])
def test_full_gradient_matches_the_stock_full_forward(block_size):
    """``gradient_mode="full"``: the Mamba-2 state is a leaf at every capture-chunk boundary (as GDN's), the prompt's
    chunks recomputed in reverse carry its gradient back; against the stock full forward + backward."""
    model = build_nemotron_h()
    prompt, comps, weights = _data(prompt_len=45)
    ref = stock_full_grads(model, prompt, comps, weights)
    got = engine_full_grads(model, prompt, comps, weights, block_size=block_size, chunk_size=7)
    assert_grads_close(got, ref)
    # the prompt's Mamba-2 state carries gradient: the response-only gradient is far from the full one there
    model.zero_grad()
    state = capture_prompt(model, prompt, chunk_size=7, page_size=6)
    for i in range(comps.shape[0]):
        (replay_logprobs(state, model, comps[i : i + 1], grad=True)[0] * weights[i]).sum().backward()
    name = "model.layers.0.mixer.in_proj.weight"
    assert _rel(param_grads(model)[name], ref[name]) > 1e-2


# ----------------------------------------------------------------------------------------------------
# State: extend, size (planner), offload
# ----------------------------------------------------------------------------------------------------
def test_extend_equals_capturing_the_whole():
    model = build_nemotron_h()
    gen = torch.Generator().manual_seed(4)
    a = torch.randint(0, VOCAB, (133,), generator=gen)
    b = torch.randint(0, VOCAB, (71,), generator=gen)
    comps, mask = padded_completions([9, 4], gen)
    state_a = capture_prompt(model, a, chunk_size=40, page_size=16)
    snap = snapshot(state_a)
    extended = extend_state(state_a, model, b)
    whole = capture_prompt(model, torch.cat([a, b]), chunk_size=40, page_size=16)
    assert extended.num_tokens == whole.num_tokens == 204
    diff = (replay_logprobs(extended, model, comps, mask) - replay_logprobs(whole, model, comps, mask)) * mask
    assert diff.abs().max() <= 1e-5
    for i in MAMBA_LAYERS:
        ext, full = extended.layers[i], whole.layers[i]
        assert ext.recurrent is not state_a.layers[i].recurrent  # rebound, not written into
        assert torch.allclose(ext.recurrent, full.recurrent, atol=1e-5)
        assert torch.allclose(ext.conv, full.conv, atol=1e-6)
    assert unchanged(snap)
    ref = stock_logprobs(model, torch.cat([a, b]), comps[:1, :9])
    assert (replay_logprobs(extended, model, comps[:1, :9]) - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("prompt_len", [5, 301])
def test_planned_state_bytes_are_what_a_capture_holds(prompt_len):
    model = build_nemotron_h()
    state = capture_prompt(model, torch.randint(0, VOCAB, (prompt_len,)), chunk_size=64, page_size=16)
    got = state.nbytes_by_kind()
    assert got == state_bytes(model.config, prompt_len, page_size=16, dtype_bytes=4)
    cfg = model.config
    conv_dim = cfg.mamba_num_heads * cfg.mamba_head_dim + 2 * cfg.n_groups * cfg.ssm_state_size
    per_layer = (
        conv_dim * (cfg.conv_kernel - 1) * 4
        + cfg.mamba_num_heads * cfg.mamba_head_dim * cfg.ssm_state_size * 4
    )
    assert got["mamba2"] == len(MAMBA_LAYERS) * per_layer  # independent of the prompt length
    assert got["kv"] == (prompt_len - 1) * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    # the Mamba-2 state is replicated over context-parallel ranks; only the pages are spread
    cp = state_bytes(cfg, prompt_len, cp_size=2, page_size=16, dtype_bytes=4)
    assert cp["mamba2"] == got["mamba2"] and cp["kv"] <= got["kv"]
    # the whole plan runs on the config (its graph terms are estimates for Nemotron-H's blocks)
    plan = plan_memory(
        cfg, prompt_len, page_size=16, dtype_bytes=4, gradient_mode="full", capture_chunk_size=64
    )
    assert plan.state_by_kind == got and plan.response_graph > 0
    # full mode: a leaf gradient of the state's size, and the state kept at every capture-chunk boundary
    buffers, kept, *_ = full_gradient_bytes(cfg, prompt_len, page_size=16, dtype_bytes=4, chunk_size=64)
    assert kept == (-(-(prompt_len - 1) // 64) - 1) * got["mamba2"]


def test_offloaded_state_keeps_mamba2_on_the_device_and_scores_the_same():
    model = build_nemotron_h()
    prompt, comps, _ = _data(prompt_len=83)
    resident = capture_prompt(model, prompt, chunk_size=30, page_size=16)
    offloaded = capture_prompt(model, prompt, chunk_size=30, page_size=16, offload_prompt_state="cpu")
    assert not Mamba2State.offloadable
    assert (
        replay_logprobs(offloaded, model, comps) - replay_logprobs(resident, model, comps)
    ).abs().max() <= 1e-6
    assert torch.equal(
        generate_from_state(offloaded, model, 2, 5, do_sample=False),
        generate_from_state(resident, model, 2, 5, do_sample=False),
    )


# ----------------------------------------------------------------------------------------------------
# Decode (generation)
# ----------------------------------------------------------------------------------------------------
def test_decode_token_by_token_equals_replay():
    model = build_nemotron_h()
    gen = torch.Generator().manual_seed(4)
    state = capture_prompt(model, torch.randint(0, VOCAB, (67,), generator=gen), chunk_size=20, page_size=8)
    snap = snapshot(state)
    tokens = torch.randint(0, VOCAB, (2, 6), generator=gen)
    start = state.resident_tokens
    with torch.no_grad():
        ctx = ForwardContext("decode", state, capacity=6)
        steps = [forward_model(model, tokens[:, i : i + 1], start + i, ctx) for i in range(6)]
        decoded = torch.cat(steps, dim=1)
        replayed = forward_model(model, tokens, start, ForwardContext("replay", state))
    assert (decoded - replayed).abs().max().item() <= 1e-5
    assert sorted(i for i, r in ctx.running.items() if isinstance(r, Mamba2State)) == MAMBA_LAYERS
    assert all(ctx.running[i].recurrent.shape[0] == 2 for i in MAMBA_LAYERS)
    assert unchanged(snap)


def test_first_token_logits_match_stock():
    """Generation's first step (the last prompt token on the captured state) gives stock's next-token logits."""
    model = build_nemotron_h()
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, VOCAB, (203,), generator=gen)
    state = capture_prompt(model, prompt, chunk_size=64, page_size=16)
    with torch.no_grad():
        ctx = ForwardContext("decode", state, capacity=1)
        first = prompt[-1:].expand(2, 1)
        logits = forward_model(model, first, state.resident_tokens, ctx, logits_to_keep=1)
        ref = model(prompt[None]).logits[:, -1]
    got = torch.log_softmax(logits[:, -1].float(), -1)
    assert (got - torch.log_softmax(ref.float(), -1)).abs().max().item() <= 1e-4


@pytest.mark.parametrize(
    "sampling",
    [dict(do_sample=False), dict(do_sample=True, temperature=0.9, top_k=20)],
    ids=["greedy", "sampled"],
)
def test_generate_matches_stock_generate(sampling):
    model = build_nemotron_h()
    prompt = torch.randint(0, VOCAB, (61,), generator=torch.Generator().manual_seed(6))
    assert_generate_matches_stock(model, prompt, 24, 5, sampling)


# ----------------------------------------------------------------------------------------------------
# Context parallelism (2 gloo ranks): pages spread, the Mamba-2 state replicated
# ----------------------------------------------------------------------------------------------------
def _cp_worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        model = build_nemotron_h()
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, VOCAB, (101,), generator=gen)
        ids = torch.randint(0, VOCAB, (3, 7), generator=gen)
        mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5])
        single = capture_prompt(model, prompt, chunk_size=24, page_size=8)
        sharded = capture_prompt(model, prompt, chunk_size=24, page_size=8, cp_group=dist.group.WORLD)
        assert sharded.nbytes_by_kind()["mamba2"] == single.nbytes_by_kind()["mamba2"]
        assert sharded.nbytes_by_kind()["kv"] < single.nbytes_by_kind()["kv"]
        # every rank holds the whole state (layer 3 reads the attention's merged partials: equal up to rounding)
        assert torch.equal(sharded.layers[0].recurrent, single.layers[0].recurrent)
        assert torch.allclose(sharded.layers[3].recurrent, single.layers[3].recurrent, atol=1e-5)
        diff = (replay_logprobs(single, model, ids, mask) - replay_logprobs(sharded, model, ids, mask)) * mask
        assert diff.abs().max() <= 1e-5, diff.abs().max()
        g_single = weighted_replay_grads(model, single, ids, mask)
        g_cp = weighted_replay_grads(model, sharded, ids, mask)
        assert (g_cp - g_single).norm() / g_single.norm() <= 1e-5
        gathered = [torch.empty_like(g_cp) for _ in range(world)]
        dist.all_gather(gathered, g_cp)
        assert all(torch.equal(gathered[0], g) for g in gathered)
        assert torch.equal(
            generate_from_state(single, model, 2, 6, do_sample=False),
            generate_from_state(sharded, model, 2, 6, do_sample=False),
        )
        # the full gradient under CP: every rank's equals the stock full one
        prompt, comps, weights = _data(prompt_len=45)
        ref = stock_full_grads(model, prompt, comps, weights)
        assert_grads_close(engine_full_grads(model, prompt, comps, weights, cp_group=dist.group.WORLD), ref)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_worker()


@pytest.mark.slow
def test_context_parallel_equals_single_process_and_stock():
    with tempfile.TemporaryDirectory() as tmp:
        run_processes(_cp_worker, (2, os.path.join(tmp, "init")), 2)


# ----------------------------------------------------------------------------------------------------
# trainer.train() against stock GRPOTrainer
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gradient_mode", ["full", "response_only"])
def test_train_one_step_under_trl_defaults_matches_stock_grpo_trainer(gradient_mode):
    """One SGD step of ``trainer.train()`` with TRL's defaults (HF gradient checkpointing on, beta 0) on the same
    scripted completions of a 59-token prompt. Full mode: the weight update equals stock GRPOTrainer's."""
    make = lambda: build_nemotron_h(vocab_size=TINY_VOCAB, **TOKEN_IDS)  # noqa: E731
    start, stock_weights, ours = train_stock_and_full(
        make,
        max_steps=1,
        num_iterations=1,
        beta=0.0,
        full_overrides=dict(gradient_mode=gradient_mode),
    )
    assert ours.state.global_step == 1 and ours.args.gradient_mode == gradient_mode
    if gradient_mode == "full":
        assert_updates_match(start, stock_weights, ours)
    else:  # the response-only gradient drops the prompt path: the update moves, but not as stock's
        moved = max((p.detach() - start[n]).abs().max() for n, p in ours.model.named_parameters())
        assert moved > 1e-3


# ----------------------------------------------------------------------------------------------------
# Patching
# ----------------------------------------------------------------------------------------------------
def test_patch_is_idempotent_and_leaves_the_stock_cached_path_alone():
    model = build_nemotron_h()
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        before = model(ids).logits
        out = model(ids[:, :9], use_cache=True)
        step = model(ids[:, 9:10], past_key_values=out.past_key_values, use_cache=True).logits
    assert apply_longstraw_to_nemotron_h(model) is model and patch_model(model) is model
    assert isinstance(find_patch(model), NemotronHPatch)
    forwards = [m.forward for m in find_patch(model).mixers(model)]
    patch_model(model)
    assert [m.forward for m in find_patch(model).mixers(model)] == forwards
    with torch.no_grad():
        assert torch.equal(before, model(ids).logits)
        out = model(ids[:, :9], use_cache=True)
        assert torch.equal(
            step, model(ids[:, 9:10], past_key_values=out.past_key_values, use_cache=True).logits
        )


def test_state_of_another_model_is_rejected():
    model = build_nemotron_h()
    state = capture_prompt(model, torch.randint(0, VOCAB, (9,)), chunk_size=8, page_size=8)
    swapped = state.fork()
    swapped.layers[0], swapped.layers[1] = swapped.layers[1], swapped.layers[0]
    with pytest.raises(LongStrawError, match="another model"):
        replay_logprobs(swapped, model, torch.randint(0, VOCAB, (1, 4)))
    missing = state.fork()
    del missing.layers[3]
    with pytest.raises(LongStrawError, match="layer 3 has no captured Mamba2State"):
        replay_logprobs(missing, model, torch.randint(0, VOCAB, (1, 4)))


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(mamba_hidden_act="gelu"), "mamba_hidden_act='gelu'"),
        (dict(attention_dropout=0.1), "attention_dropout"),
    ],
    ids=["conv-activation", "attention-dropout"],
)
def test_unsupported_options_raise(change, match):
    model = build_nemotron_h()
    for key, value in change.items():
        setattr(model.config, key, value)
    with pytest.raises(UnsupportedModelError, match=match):
        patch_model(model)


def test_config_pattern_is_the_layout():
    cfg = nemotron_h_config()
    assert cfg.hybrid_override_pattern == "M*-ME"
    patch = NemotronHPatch()
    assert [patch.layer_state_type(cfg, i) for i in range(5)] == [
        Mamba2State,
        KVPages,
        None,
        Mamba2State,
        None,
    ]
