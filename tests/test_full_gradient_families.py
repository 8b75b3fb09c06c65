"""``gradient_mode="full"`` beyond K/V pages and GDN states, fp32 on CPU: sliding-window layers (Gemma 2's soft-caps,
GPT-OSS's sinks), GLM-5's MLA latent under a DSA selection that drops keys, and the MoE router loss.

References (never the engine itself): the stock HF model's full forward + backward on ``prompt + completion`` (engine
level), stock TRL ``GRPOTrainer`` unpatched (micro-batch and ``trainer.train()`` level, on the same completions).
Every prompt is longer than the window (8) and than ``index_topk`` (6), so the window's and the selection's prompt
keys decide the results; the engine test also checks that the response-only gradient differs there (the prompt path
matters). Negative controls watched failing: the window's or the latent's gradient dropped, the window's gradient cut
at chunk boundaries, the latent rows' value part dropped, the prompt tokens' router-loss share dropped or mis-weighted.
"""

from __future__ import annotations

import copy
import functools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from _models import build_glm_dsa, build_window
from _reference import (
    VOCAB,
    assert_grads_close,
    engine_full_grads,
    param_grads,
    stock_full_grads,
)
from _spawn import exit_worker, run_processes
from _trl_helpers import (
    TINY_VOCAB,
    assert_micro_batch_matches_stock,
    assert_updates_match,
    make_tiny_grpo_trainer,
    make_tiny_longstraw_trainer,
    random_grpo_inputs,
    tiny_qwen3_moe,
    train_stock_and_full,
)

from longstraw_trl import LongStrawError, capture_prompt, replay_logprobs
from longstraw_trl.engine import StateGrads
from longstraw_trl.layer_state import KVPages, WindowKV
from longstraw_trl.model_patches.glm_moe_dsa import DSAPages
from longstraw_trl.planner import full_gradient_bytes
from longstraw_trl.state_cache import prompt_key

SMALL_TOPK = 6  # GLM-5's index_topk: every query past position 6 drops keys
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # the toy tokenizer's


def _data(seed: int = 1, prompt_len: int = 21, g: int = 2, r: int = 6):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen)
    comps = torch.randint(0, VOCAB, (g, r), generator=gen)
    return prompt, comps, torch.randn(g, r, generator=gen)


def _response_only_grads(model, prompt, comps, weights):
    model.zero_grad()
    state = capture_prompt(model, prompt, chunk_size=8, page_size=6)
    for i in range(comps.shape[0]):
        (replay_logprobs(state, model, comps[i : i + 1], grad=True)[0] * weights[i]).sum().backward()
    return param_grads(model)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def _build(family: str):
    if family == "glm_moe_dsa":
        return build_glm_dsa(index_topk=SMALL_TOPK)
    return build_window(family)


# ----------------------------------------------------------------------------------------------------
# Engine: the full gradient against the stock model's full forward + backward
# ----------------------------------------------------------------------------------------------------
# gemma2: sliding + global layers, attention and final soft-caps, chunks of 5 (< the window's 7 prompt keys: a window
# spans chunk boundaries); gpt_oss: sinks, window, MoE; mistral (every layer a window) through reverse block replay;
# glm_moe_dsa: MLA latent + DSA top-k 6 of up to 26 keys
ENGINE_CASES = {
    "gemma2": dict(chunk_size=5, prompt_path="model.layers.0.self_attn.k_proj.weight"),
    "gpt_oss": dict(prompt_path="model.layers.2.self_attn.k_proj.weight"),
    "mistral": dict(block_size=2, prompt_path="model.layers.0.self_attn.k_proj.weight"),
    "glm_moe_dsa": dict(prompt_path="model.layers.1.self_attn.kv_a_proj_with_mqa.weight"),
    # offloaded latent pages: the prompt part reads them whole (its rows index them), the buffers live on the host
    "glm_moe_dsa-offload": dict(
        offload_prompt_state="cpu", prompt_path="model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    ),
}


@pytest.mark.parametrize("family", list(ENGINE_CASES))
def test_full_gradient_matches_the_stock_full_forward(family):
    case = dict(ENGINE_CASES[family])
    name = case.pop("prompt_path")
    model = _build(family.split("-")[0])
    prompt, comps, weights = _data()
    ref = stock_full_grads(model, prompt, comps, weights)
    got = engine_full_grads(model, prompt, comps, weights, **case)
    assert_grads_close(got, ref)
    # the prompt's K/V (window, latent) carry the gradient there: the response-only one is far from it
    assert _rel(_response_only_grads(model, prompt, comps, weights)[name], ref[name]) > 1e-2
    if family.startswith("glm_moe_dsa"):
        assert ref.keys() == got.keys() and not any(".indexer." in n for n in got)  # HF's indexer: no_grad
        assert any("kv_b_proj" in n for n in got)


def test_glm_selection_drops_prompt_keys_and_the_latent_gets_their_gradient_only():
    """The DSA top-k leaves most prompt keys out; the latent rows no response query selected get no gradient from
    the replays (the top-k is a constant, as in HF), the selected ones do."""
    model = build_glm_dsa(index_topk=SMALL_TOPK)
    prompt, comps, _ = _data(prompt_len=29)
    state = capture_prompt(model, prompt, chunk_size=8, page_size=6, keep_boundaries=True)
    grads = StateGrads(state)
    replay_logprobs(state, model, comps[:1, :2], grad=True, grads=grads).sum().backward()
    for idx in (0, 2):  # the "full" indexer layers
        layer = state.layers[idx]
        assert isinstance(layer, DSAPages) and layer.num_tokens == 28
        dk, dv = grads.kv(idx).take(0, 28, torch.device("cpu"))
        touched = dk[0].abs().sum(-1) > 0
        # 2 queries choose at most 2 x 6 prompt rows: most of the 28 get nothing, some do
        assert 0 < int(touched.sum()) <= 2 * SMALL_TOPK < 28
        assert not dv.any()  # the indexer keys: no gradient (HF's indexer runs under no_grad)


# ----------------------------------------------------------------------------------------------------
# Planner: the new gradient buffers and boundary states as a replay and the capture hold them
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gemma2", "glm_moe_dsa"])
def test_planned_full_gradient_bytes_are_what_the_state_holds(family):
    """Window leaves (their gradient, a snapshot at every chunk boundary) and the latent pages' fp32 buffers (none for
    the indexer keys, which take no gradient) as ``full_gradient_bytes`` counts them (fp32 model: 4 bytes a value)."""
    model = _build(family)
    prompt, comps, _ = _data(prompt_len=29)
    state = capture_prompt(model, prompt, chunk_size=8, page_size=6, keep_boundaries=True)
    grads = StateGrads(state)
    replay_logprobs(state, model, comps[:1], grad=True, grads=grads).sum().backward()
    buffers, kept, workspace, _, _ = full_gradient_bytes(
        model.config, prompt.numel(), page_size=6, dtype_bytes=4, chunk_size=8
    )
    assert grads.nbytes() == buffers
    held = sum(kept_layer.nbytes() for at in state.boundaries.values() for kept_layer in at.values())
    assert held == kept
    kinds = {type(layer) for layer in state.layers.values()}
    assert kinds == ({WindowKV, KVPages} if family == "gemma2" else {DSAPages})
    if family == "glm_moe_dsa":  # the latent's buffer only
        assert buffers == state.nbytes_by_kind()["mla"] < state.nbytes()
    assert workspace == max(
        grads.kv(i).nbytes() for i, layer in state.layers.items() if layer.grad_kind == "buffer"
    )


# ----------------------------------------------------------------------------------------------------
# Trainer: micro-batch against stock GRPOTrainer, and train() under TRL's defaults
# ----------------------------------------------------------------------------------------------------
AUX_LENGTHS = [6, 0, 4, 2]  # one row without completion tokens: TRL still routes its prompt


def test_router_aux_loss_in_full_mode_matches_stock_grpo_trainer():
    """qwen3_moe with the config's router_aux_loss_coef: in full mode the load-balancing loss's gradient reaches the
    routers of the prompt's tokens too (TRL's full-sequence forward routes them with autograd), HF checkpointing on."""
    model = tiny_qwen3_moe(router_aux_loss_coef=0.3)
    trl = make_tiny_grpo_trainer(model=copy.deepcopy(model), bf16=False, beta=0.0)
    assert trl.aux_loss_enabled and trl.router_aux_loss_coef == 0.3
    ours = make_tiny_longstraw_trainer(
        model=copy.deepcopy(model), gradient_mode="full", capture_chunk_size=8, page_size=6
    )
    ours.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    inputs, _, _ = random_grpo_inputs(AUX_LENGTHS, seed=7, prompt_len=21, max_len=6)
    inputs["prompt_ids"] = inputs["prompt_ids"][:1].expand_as(inputs["prompt_ids"]).clone()
    prompt = inputs["prompt_ids"][0]
    ours_inputs = {k: v for k, v in inputs.items() if k not in ("prompt_ids", "prompt_mask")}
    ours_inputs["longstraw_prompts"] = [(prompt_key(prompt), prompt)]
    trl._metrics["train"].clear()
    assert_micro_batch_matches_stock(trl, ours, inputs, ours_inputs)
    assert ours._metrics["train"]["aux_loss"][-1] == pytest.approx(
        trl._metrics["train"]["aux_loss"][-1], rel=1e-5
    )


def test_router_aux_loss_with_reverse_block_replay_is_refused_by_name():
    with pytest.raises(
        LongStrawError, match="router_aux_loss_coef != 0 is not supported with replay_block_size"
    ):
        make_tiny_longstraw_trainer(
            model=tiny_qwen3_moe(router_aux_loss_coef=0.3), gradient_mode="full", replay_block_size=2
        )


TRAIN_MODELS = {
    "gemma2": lambda: build_window("gemma2", vocab_size=TINY_VOCAB, **TOKEN_IDS),
    "gpt_oss": lambda: build_window("gpt_oss", vocab_size=TINY_VOCAB, **TOKEN_IDS),
    "glm_moe_dsa": lambda: build_glm_dsa(index_topk=SMALL_TOPK, vocab_size=TINY_VOCAB, **TOKEN_IDS),
    "qwen3_moe_router_aux": functools.partial(tiny_qwen3_moe, router_aux_loss_coef=0.3),
}


@pytest.mark.parametrize(
    "family",
    ["gemma2", pytest.param("gpt_oss", marks=pytest.mark.slow), "glm_moe_dsa", "qwen3_moe_router_aux"],
)
def test_train_full_gradient_under_trl_defaults_matches_stock_grpo_trainer(family):
    """`trainer.train()` with TRL's defaults (HF gradient checkpointing on, beta 0), one SGD step on the same scripted
    completions of a 59-token prompt (window 8, top-k 6: the prompt's K/V and latent decide the gradient): the
    weight update equals stock GRPOTrainer's."""
    start, stock_weights, ours = train_stock_and_full(
        TRAIN_MODELS[family], max_steps=1, num_iterations=1, beta=0.0
    )
    assert ours.state.global_step == 1 and ours.args.gradient_mode == "full"
    if family == "qwen3_moe_router_aux":
        assert ours.aux_loss_enabled
    assert_updates_match(start, stock_weights, ours)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["gemma2", "gpt_oss", "glm_moe_dsa"])
@pytest.mark.parametrize("offload", [None, "cpu"])
def test_full_gradient_on_cuda_bf16(family, offload):
    """The CUDA paths (window attention, soft-caps, sinks; the selected-keys kernels and the latent buffers, pinned
    host buffers when offloaded) against the stock model's fp32 full gradient on the CPU: in fp32 to 1e-4; in bf16
    each parameter's gradient and the whole gradient no further from it than twice the stock model's own bf16
    gradient is (10% and 5% at least). The routers' and the indexer's top-k flip under bf16 rounding, so a fixed bf16
    tolerance measures the family, not the engine: on an H100, GLM-5's q_a_proj was 36% off in bf16 (stock's own:
    35.5%), its embedding 15% (13.9%), gpt_oss's router bias 5.8% (1.7%); the fp32 paths were exact. A dropped or
    sign-flipped gradient is 100-200% off."""
    model = _build(family)
    prompt, comps, weights = _data(prompt_len=61)
    ref = stock_full_grads(model, prompt, comps, weights)
    cuda = (prompt.cuda(), comps.cuda(), weights.cuda())
    fp32 = copy.deepcopy(model).cuda()
    got = engine_full_grads(fp32, *cuda, block_size=4, offload_prompt_state=offload)
    for name, g in ref.items():
        rel = _rel(got[name].float().cpu(), g)
        assert rel <= 1e-4, f"fp32 {name}: relative L2 {rel:.2e}"
    bf16 = model.cuda().to(torch.bfloat16)
    stock = stock_full_grads(copy.deepcopy(bf16), *cuda)
    got = engine_full_grads(bf16, *cuda, block_size=4, offload_prompt_state=offload)
    for name, g in ref.items():
        rel, stock_rel = _rel(got[name].float().cpu(), g), _rel(stock[name].float().cpu(), g)
        assert rel <= max(0.1, 2 * stock_rel), (
            f"bf16 {name}: relative L2 {rel:.2e} (stock bf16: {stock_rel:.2e})"
        )
    whole = torch.cat([g.flatten() for g in ref.values()])
    ours = _rel(torch.cat([got[n].float().cpu().flatten() for n in ref]), whole)
    theirs = _rel(torch.cat([stock[n].float().cpu().flatten() for n in ref]), whole)
    assert ours <= max(5e-2, 2 * theirs), (
        f"bf16 whole gradient: relative L2 {ours:.2e} (stock bf16: {theirs:.2e})"
    )


def _cp_worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        for family in ("gemma2", "glm_moe_dsa"):
            model = _build(family)
            prompt, comps, weights = _data()
            ref = stock_full_grads(model, prompt, comps, weights)
            got = engine_full_grads(model, prompt, comps, weights, cp_group=dist.group.WORLD)
            assert_grads_close(got, ref)
    finally:
        dist.destroy_process_group()
    exit_worker()


@pytest.mark.slow
def test_full_gradient_under_context_parallelism_matches_stock():
    """Two gloo ranks, pages (full-attention K/V, GLM-5's latent) spread over them, the windows on both: every rank's
    gradient is the stock full one."""
    with tempfile.TemporaryDirectory() as tmp:
        run_processes(_cp_worker, (2, os.path.join(tmp, "init")), nprocs=2)
