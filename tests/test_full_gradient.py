"""The full-sequence gradient (``gradient_mode="full"``) and reverse block replay, fp32 on CPU.

References (never the engine itself):
- the full gradient: the stock HF model's full forward on ``prompt + completion`` with autograd everywhere (the
  prompt's tokens included), and stock TRL ``GRPOTrainer`` unpatched (its loss runs that same full forward);
- reverse block replay: a plain whole replay (itself checked against the stock response-only reference in
  tests/test_engine_*.py), and the stock full gradient when combined with the full mode.
Prompts span several capture chunks (29 tokens in chunks of 8, pages of 6), so the reverse prompt recompute crosses
chunk and page boundaries and carries GDN states across chunks.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile

import pytest
import torch
from _models import HYBRID_COMMON, MROPE_INTERLEAVED, build, build_hybrid, build_window
from _reference import (
    VOCAB,
    assert_grads_close,
    engine_full_grads,
    param_grads,
    stock_full_grads,
    with_lora,
)
from _trl_helpers import (
    TINY_VOCAB,
    assert_micro_batch_matches_stock,
    assert_updates_match,
    make_tiny_grpo_trainer,
    make_tiny_longstraw_trainer,
    random_grpo_inputs,
    train_stock_and_full,
)

from longstraw_trl import LongStrawError, capture_prompt, engine, extend_state, replay_logprobs
from longstraw_trl.engine import StateGrads, prompt_backward, replay_blocks_backward
from longstraw_trl.layer_state import WindowKV
from longstraw_trl.state_cache import prompt_key

FAMILIES = ["qwen3", "qwen3_5"]  # GQA; hybrid (GDN + gated full attention)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj", "down_proj"]


def _model(family: str):
    return build(family) if family == "qwen3" else build_hybrid(family)


def _data(seed: int = 1, prompt_len: int = 29, g: int = 3, r: int = 11):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen)
    comps = torch.randint(0, VOCAB, (g, r), generator=gen)
    return prompt, comps, torch.randn(g, r, generator=gen)


# ----------------------------------------------------------------------------------------------------
# Engine: the full gradient against the stock model
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["plain", "lora", "offload"])
@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_backward_gives_the_stock_full_sequence_gradient(family, variant):
    model = _model(family)
    if variant == "lora":
        model = with_lora(model, [t for t in LORA_TARGETS if family == "qwen3_5" or "proj_" not in t])
    prompt, comps, weights = _data()
    ref = stock_full_grads(model, prompt, comps, weights)
    got = engine_full_grads(
        model, prompt, comps, weights, offload_prompt_state="cpu" if variant == "offload" else None
    )
    assert_grads_close(got, ref)


def test_the_prompt_path_matters_here():
    """The tests above could not pass with the response-only gradient: it differs from the full one here."""
    model = _model("qwen3_5")
    prompt, comps, weights = _data()
    ref = stock_full_grads(model, prompt, comps, weights)
    state = capture_prompt(model, prompt, chunk_size=8, page_size=6)
    model.zero_grad()
    for i in range(3):
        (replay_logprobs(state, model, comps[i : i + 1], grad=True)[0] * weights[i]).sum().backward()
    rel = max(((g - ref[n]).norm() / ref[n].norm()).item() for n, g in param_grads(model).items())
    assert rel > 1e-2


def test_prompt_gradient_buffers_and_leaves_are_what_the_design_says():
    """One fp32 dK/dV buffer per attention layer the size of its pages; one GDN leaf per boundary used."""
    model = _model("qwen3_5")
    prompt, comps, _ = _data()
    state = capture_prompt(model, prompt, chunk_size=8, page_size=6, keep_boundaries=True)
    assert sorted(state.boundaries) == [8, 16, 24]  # 28 resident tokens in chunks of 8
    grads = StateGrads(state)
    replay_logprobs(state, model, comps[:1], grad=True, grads=grads)[0].sum().backward()
    kv = state.layers[1]
    fp32_factor = 4 // kv.dtype.itemsize  # fp32 buffers: the K/V's size here (fp32), twice it for bf16 K/V
    assert grads.kv(1).nbytes() == kv.stored_tokens() * kv.token_bytes() * fp32_factor
    assert {key for key in grads._leaves} == {(28, 0), (28, 2)}


def test_prompt_backward_holds_two_boundaries_leaves_at_a_time(monkeypatch):
    """A boundary's GDN leaf (and its gradient) is dropped once the segment ending there has taken it: while a segment
    runs, only its start's leaf and its end's carried one are held (kept, they had grown with the prompt: 8.8 GiB more
    at 262K than at 16K on the whole 27B), and the gradient is unchanged."""
    model = _model("qwen3_5")
    prompt, comps, weights = _data(prompt_len=45)
    ref = stock_full_grads(model, prompt, comps, weights)
    held = []
    stock_segment = engine.backward_segment

    def segment(model, state, grads, ids, start, *args, **kwargs):
        out = stock_segment(model, state, grads, ids, start, *args, **kwargs)
        held.append((start, grads.leaves_held()))
        return out

    monkeypatch.setattr(engine, "backward_segment", segment)
    got = engine_full_grads(model, prompt, comps, weights)
    assert_grads_close(got, ref)
    # 44 resident tokens in chunks of 8: segments from the last (40) to the first; after each, the leaves at its start
    # (taken next) and at its end (released right after it) only
    assert [s for s, _ in held] == [40, 32, 24, 16, 8, 0]
    assert all(leaves == sorted({s, s + 8} & {8, 16, 24, 32, 40, 44}) for s, leaves in held[1:]), held
    assert held[0][1] == [40, 44]


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_backward_through_an_extended_state(family):
    """A state extended from a cached prefix (the trainer's prompt cache, a new turn) keeps what the prompt backward
    needs: its segments start at the prefix's chunk boundaries, then at the extension's."""
    model = _model(family)
    prompt, comps, weights = _data()
    ref = stock_full_grads(model, prompt, comps, weights)
    model.zero_grad()
    prefix = capture_prompt(model, prompt[:13], chunk_size=8, page_size=6, keep_boundaries=True)
    state = extend_state(prefix, model, prompt[13:])
    assert sorted(state.boundaries) == [8, 12, 20]  # the prefix's chunk, then the extension's from token 12
    grads = StateGrads(state)
    for i in range(3):
        (
            replay_logprobs(state, model, comps[i : i + 1], grad=True, grads=grads)[0] * weights[i]
        ).sum().backward()
    prompt_backward(state, model, grads)
    assert_grads_close(param_grads(model), ref)


# ----------------------------------------------------------------------------------------------------
# Engine: reverse block replay
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_reverse_block_replay_equals_a_plain_replay(family):
    """Block sizes that divide R (11: one block), do not (3, 4), and exceed it (16); the loss couples the tokens
    (a sequence-level term), so a block's share is the response's loss through its own tokens only."""
    model = _model(family)
    prompt, comps, weights = _data()
    state = capture_prompt(model, prompt, chunk_size=8, page_size=6)

    def loss(lp, h, w):
        return (lp * w).sum() + 0.3 * (lp.mean() ** 2)  # a sequence-level term couples the tokens

    model.zero_grad()
    for i in range(3):
        loss(replay_logprobs(state, model, comps[i : i + 1], grad=True)[0], None, weights[i]).backward()
    ref = param_grads(model)
    plain = replay_logprobs(state, model, comps)
    for block in (3, 4, 11, 16):
        model.zero_grad()
        for i in range(3):
            logps, _, value = replay_blocks_backward(
                state, model, comps[i], block, lambda lp, h, w=weights[i]: loss(lp, h, w)
            )
            torch.testing.assert_close(logps, plain[i], atol=1e-5, rtol=0)
            torch.testing.assert_close(value, loss(plain[i], None, weights[i]), atol=1e-5, rtol=1e-5)
        assert_grads_close(param_grads(model), ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_reverse_block_replay_in_full_mode_gives_the_stock_full_gradient(family):
    model = _model(family)
    prompt, comps, weights = _data()
    ref = stock_full_grads(model, prompt, comps, weights)
    assert_grads_close(engine_full_grads(model, prompt, comps, weights, block_size=4), ref)


def test_reverse_block_replay_with_lora_and_offload():
    model = with_lora(_model("qwen3_5"), LORA_TARGETS)
    prompt, comps, weights = _data()
    ref = stock_full_grads(model, prompt, comps, weights)
    assert_grads_close(
        engine_full_grads(model, prompt, comps, weights, block_size=3, offload_prompt_state="cpu"), ref
    )


# ----------------------------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------------------------
def test_prompt_backward_needs_kept_boundaries():
    model = _model("qwen3")
    state = capture_prompt(model, torch.arange(20) % VOCAB, chunk_size=8)
    grads = StateGrads(state)
    with pytest.raises(LongStrawError, match="keep_boundaries=True"):
        prompt_backward(state, model, grads)
    other = capture_prompt(model, torch.arange(20) % VOCAB, chunk_size=8, keep_boundaries=True)
    with pytest.raises(LongStrawError, match="another prompt state"):
        prompt_backward(other, model, grads)


class WindowWithoutGradient(WindowKV):
    """A layer kind that declares no full gradient (every built-in kind has one)."""

    grad_kind = None


def test_layer_kinds_without_a_full_gradient_are_refused():
    model = build_window("mistral")
    state = capture_prompt(model, torch.arange(20) % VOCAB, chunk_size=8, keep_boundaries=True)
    state.layers[0] = WindowWithoutGradient(state.layers[0].window, state.layers[0].k, state.layers[0].v)
    with pytest.raises(LongStrawError, match="WindowWithoutGradient, which has no full gradient"):
        replay_logprobs(state, model, torch.arange(5)[None], grad=True, grads=StateGrads(state))
    with pytest.raises(LongStrawError, match="no full gradient"):
        replay_blocks_backward(state, model, torch.arange(5), 2, lambda lp, h: lp.sum())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(gradient_mode="fully"), "gradient_mode must be one of"),
        (dict(gradient_mode="full", refresh_policy="reuse"), "refresh_policy='recapture'"),
        (dict(replay_block_size=0), "replay_block_size must be positive"),
    ],
)
def test_config_refuses_what_it_cannot_make_exact(kwargs, match):
    with pytest.raises(LongStrawError, match=match):
        make_tiny_longstraw_trainer(**kwargs)


# ----------------------------------------------------------------------------------------------------
# Trainer: gradient_mode="full" against stock GRPOTrainer (unpatched: TRL's own full-sequence gradient)
# ----------------------------------------------------------------------------------------------------
LENGTHS = [7, 3, 5, 1]
PROMPT_LEN = 21  # 20 resident tokens: 3 capture chunks of 8


@functools.cache
def _tiny_hybrid_dir() -> str:
    """A saved tiny Qwen3.5 (TRL loads its reference model from the policy's path when beta != 0)."""
    path = tempfile.mkdtemp(prefix="longstraw_tiny_qwen3_5_")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    _new_tiny_hybrid().save_pretrained(path)
    return path


def _tiny_hybrid():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(_tiny_hybrid_dir()).float()


def _new_tiny_hybrid():
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        **{**HYBRID_COMMON, "vocab_size": TINY_VOCAB},
        rope_parameters=MROPE_INTERLEAVED,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # as tests/_models.py: every GDN head carries state across chunks
        gen = torch.Generator().manual_seed(1234)
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.1, 2.0, generator=gen).log())
    return model.float()


def _models(family: str, lora: bool):
    if family == "qwen3":
        from _trl_helpers import tiny_model_dir
        from transformers import Qwen3ForCausalLM

        make = lambda: Qwen3ForCausalLM.from_pretrained(tiny_model_dir())  # noqa: E731
    else:
        make = _tiny_hybrid
    pair = [make(), make()]
    if lora:
        targets = LORA_TARGETS if family == "qwen3_5" else ["q_proj", "v_proj", "down_proj"]
        pair = [with_lora(m, targets) for m in pair]
        pair[1].load_state_dict(pair[0].state_dict())
    return pair


def _trainer_pair(family: str, lora: bool = False, replay_block_size: int | None = None, **kwargs):
    stock_model, our_model = _models(family, lora)
    trl = make_tiny_grpo_trainer(model=stock_model, bf16=False, **kwargs)  # fp32: no CPU autocast
    ours = make_tiny_longstraw_trainer(
        model=our_model,
        gradient_mode="full",
        capture_chunk_size=8,
        page_size=6,
        replay_block_size=replay_block_size,
        **kwargs,
    )
    return trl, ours


def _batch(seed: int, beta: float):
    inputs, _, _ = random_grpo_inputs(LENGTHS, seed=seed, beta=beta, prompt_len=PROMPT_LEN)
    inputs["prompt_ids"] = inputs["prompt_ids"][:1].expand_as(inputs["prompt_ids"]).clone()
    prompt = inputs["prompt_ids"][0]
    ours = {k: v for k, v in inputs.items() if k not in ("prompt_ids", "prompt_mask")}
    ours["longstraw_prompts"] = [(prompt_key(prompt), prompt)]
    return inputs, ours


@pytest.mark.parametrize(
    "family,lora,loss_type,level",
    [
        ("qwen3", False, "dapo", "token"),
        ("qwen3", False, "grpo", "sequence"),
        ("qwen3", True, "bnpo", "token"),
        ("qwen3_5", False, "dapo", "token"),
        ("qwen3_5", True, "grpo", "token"),
        ("qwen3_5", False, "dapo", "checkpointing"),
    ],
)
def test_trainer_full_gradient_matches_stock_grpo_trainer(family, lora, loss_type, level):
    """`level="checkpointing"`: HF gradient checkpointing on (TRL's default); the segments then use the engine's own
    non-reentrant layer checkpointing."""
    checkpointing = level == "checkpointing"
    level = "token" if checkpointing else level
    kwargs = dict(loss_type=loss_type, beta=0.04, importance_sampling_level=level)
    trl, ours = _trainer_pair(family, lora, **kwargs)
    if checkpointing:
        ours.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    inputs, ours_inputs = _batch(3, 0.04)
    assert_micro_batch_matches_stock(trl, ours, inputs, ours_inputs)
    assert ours._metrics["train"]["longstraw/prompt_backward_seconds"]


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_full_gradient_with_reverse_block_replay(family):
    kwargs = dict(loss_type="grpo", beta=0.04, importance_sampling_level="sequence")
    trl, ours = _trainer_pair(family, replay_block_size=3, **kwargs)
    inputs, ours_inputs = _batch(4, 0.04)
    assert_micro_batch_matches_stock(trl, ours, inputs, ours_inputs)


@pytest.mark.parametrize("extra", [{}, {"entropy_coef": 0.05}])
def test_trainer_reverse_block_replay_response_only_equals_whole_replays(extra):
    whole = make_tiny_longstraw_trainer(loss_type="dapo", beta=0.04, capture_chunk_size=8, **extra)
    blocks = make_tiny_longstraw_trainer(
        loss_type="dapo", beta=0.04, capture_chunk_size=8, replay_block_size=2, **extra
    )
    _, ours_inputs = _batch(5, 0.04)
    results = []
    for t in (whole, blocks):
        t.model.train()
        t.model.zero_grad()
        results.append((t.micro_batch_loss(t.model, ours_inputs, backward=True), param_grads(t.model)))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=0)
    assert_grads_close(results[1][1], results[0][1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("offload", [None, "cpu"])
def test_full_gradient_on_cuda_bf16(family, offload, monkeypatch):
    """The CUDA paths (cuDNN / flash forward, flash backward with the pages' dK/dV, the torch GDN rule's backward,
    pinned host buffers when offloaded) in bf16 against the stock model's fp32 full gradient."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    # the fp32 reference runs on the CPU: with fla importable HF would route its GDN rule to fla's Triton kernels,
    # which take no CPU tensors, so the reference takes HF's own torch rule (the function fla's wrapper replaced)
    rule = modeling_qwen3_5.torch_chunk_gated_delta_rule
    monkeypatch.setattr(modeling_qwen3_5, "torch_chunk_gated_delta_rule", getattr(rule, "__wrapped__", rule))
    model = _model(family)
    prompt, comps, weights = _data(prompt_len=61)
    ref = stock_full_grads(model, prompt, comps, weights)
    monkeypatch.undo()
    model = model.cuda().to(torch.bfloat16)
    got = engine_full_grads(
        model, prompt.cuda(), comps.cuda(), weights.cuda(), block_size=4, offload_prompt_state=offload
    )
    for name, g in ref.items():
        rel = ((got[name].float().cpu() - g).norm() / g.norm().clamp_min(1e-12)).item()
        assert rel <= 5e-2, f"{name}: relative L2 {rel:.2e}"


# ----------------------------------------------------------------------------------------------------
# train() under TRL's defaults (HF gradient checkpointing on) against stock GRPOTrainer, on the same completions
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lora", [False, True])
def test_train_full_gradient_under_trl_defaults_matches_stock_grpo_trainer(lora):
    """`gradient_mode="full"` through `trainer.train()` with TRL's default HF gradient checkpointing, the reference
    model (beta), two iterations per generation: the weight updates of two SGD steps equal stock GRPOTrainer's.
    (Before the fix: `CheckpointError: A different number of tensors was saved`, HF's checkpoint nested in the
    engine's on the replays' recompute.)"""
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"])
    start, stock_weights, ours = train_stock_and_full(peft_config=peft_config if lora else None)
    assert ours.state.global_step == 2 and ours.args.gradient_mode == "full"
    if lora:
        assert any("lora_" in n for n in start)
    assert_updates_match(start, stock_weights, ours)


def _mark_prompt_backward(monkeypatch) -> list:
    """A list that is non-empty while the loss's prompt backward runs (``streamed_loss.prompt_backward`` wrapped)."""
    import longstraw_trl.streamed_loss as streamed_loss

    inside = []
    real = streamed_loss.prompt_backward

    def marked(*args, **kwargs):
        inside.append(1)
        try:
            return real(*args, **kwargs)
        finally:
            inside.pop()

    monkeypatch.setattr(streamed_loss, "prompt_backward", marked)
    return inside


@pytest.mark.parametrize("checkpointed", [None, False], ids=["as_trl", "off"])
def test_train_full_gradient_with_and_without_prompt_backward_checkpointing(checkpointed, monkeypatch):
    """`prompt_backward_checkpoint_layers=False` under TRL's default checkpointing: the prompt backward's chunks keep
    every layer's activations (the engine's layer checkpoint is never entered: one forward less per layer) and the
    weight updates still equal stock GRPOTrainer's; `None` checkpoints them as TRL's option says."""
    import longstraw_trl.hooks as hooks

    entered = []  # the engine's layer checkpoints entered during a prompt backward (not the replays')
    inside = _mark_prompt_backward(monkeypatch)
    real_checkpoint = hooks.checkpoint

    def counted(*args, **kwargs):
        if inside:
            entered.append(1)
        return real_checkpoint(*args, **kwargs)

    monkeypatch.setattr(hooks, "checkpoint", counted)
    start, stock_weights, ours = train_stock_and_full(
        full_overrides={"prompt_backward_checkpoint_layers": checkpointed}
    )
    assert ours.args.gradient_checkpointing and ours.args.gradient_mode == "full"
    assert bool(entered) == (checkpointed is None), len(entered)
    assert_updates_match(start, stock_weights, ours)


@pytest.mark.parametrize("fused", [True, False])
def test_train_full_gradient_with_autograd_fused_kernels_matches_stock(fused, monkeypatch):
    """`autograd_fused_kernels` (the fused norm / SiLU-MLP kernels with their own backward, here in the Triton
    interpreter on the CPU) through `trainer.train()` under TRL's defaults (HF checkpointing on: the replays' and the
    prompt backward's recomputes must run the kernels their first pass ran, or checkpointing raises): the weight
    updates equal stock GRPOTrainer's, and the kernels ran under autograd in the replays and the prompt backward."""
    triton = pytest.importorskip("triton")
    if not triton.knobs.runtime.interpret:
        pytest.skip(
            "the Triton interpreter is off (CUDA present, or Triton imported before tests/conftest.py)"
        )
    from longstraw_trl import fused_forwards
    from longstraw_trl.kernels.elementwise import fused as elementwise

    monkeypatch.setattr(elementwise, "_KERNEL_DEVICE", "cpu")  # the kernels take CPU tensors (interpreter)
    calls = {"rms_norm_fn": [], "silu_mul_fn": []}
    in_prompt_backward = _mark_prompt_backward(monkeypatch)

    def counted(name):
        real = getattr(fused_forwards, name)

        def fn(*args, **kwargs):
            calls[name].append(bool(in_prompt_backward))
            return real(*args, **kwargs)

        return fn

    for name in calls:
        monkeypatch.setattr(fused_forwards, name, counted(name))
    start, stock_weights, ours = train_stock_and_full(full_overrides={"autograd_fused_kernels": fused})
    assert ours.args.gradient_checkpointing and ours.args.autograd_fused_kernels == fused
    for name, where in calls.items():  # replays (outside the prompt backward) and segments (inside)
        assert (set(where) == {False, True}) if fused else not where, (name, len(where))
    assert_updates_match(start, stock_weights, ours)


def _replayed_for_prompt_backward(family: str):
    """A tiny model, a 25-token prompt captured in chunks of 8 with its boundaries kept, and the gradient one replay
    sent to the prompt state: what a prompt backward starts from."""
    model = build("qwen3") if family == "qwen3" else build_hybrid("qwen3_5")
    gen = torch.Generator().manual_seed(5)
    state = capture_prompt(
        model, torch.randint(0, VOCAB, (25,), generator=gen), chunk_size=8, keep_boundaries=True
    )
    grads = StateGrads(state)
    replay_logprobs(
        state, model, torch.randint(0, VOCAB, (1, 6), generator=gen), grad=True, grads=grads
    ).sum().backward()
    return model, state, grads


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_checkpointed_prompt_backward_keeps_no_recomputed_layer(family, monkeypatch):
    """A checkpointed segment layer runs again when backward recomputes it; what it emits then is not kept (it held
    every recomputed layer's activations until the segment's backward ended: the whole Qwen3.6-27B ran out of memory
    at a 16K-token chunk). Each layer emits once per segment; the gradient is unchanged (the tests above)."""
    import longstraw_trl.engine as engine

    contexts = []

    class Recording(engine.ForwardContext):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            contexts.append(self)

    monkeypatch.setattr(engine, "ForwardContext", Recording)
    model, state, grads = _replayed_for_prompt_backward(family)
    prompt_backward(state, model, grads, checkpoint_layers=True)
    segments = [c for c in contexts if c.segment is not None]
    assert len(segments) == 3  # chunks of 8, 8 and 8 resident tokens, in reverse
    layers = model.config.num_hidden_layers
    for ctx in segments:
        assert 0 < len(ctx.emitted) <= 2 * layers  # K and V, or conv and recurrent state: once per layer


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_checkpointed_prompt_backward_attends_to_the_pages_once(family, monkeypatch):
    """A checkpointed segment layer's recompute reuses the page attention of its first forward (the quadratic part of
    the recompute, and with offload a second stream of every page from the host): one page pass an attention layer
    a segment, not two. The gradient stays the stock one (the tests above run checkpointed segments too)."""
    import longstraw_trl.context as context
    import longstraw_trl.kernels.attention.prompt_response as attention

    calls = []
    real = attention.pages_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    model, state, grads = _replayed_for_prompt_backward(family)
    monkeypatch.setattr(context, "pages_attention", counted)  # the kept part's first forward
    monkeypatch.setattr(attention, "pages_attention", counted)  # a part computed where it is used
    prompt_backward(state, model, grads, checkpoint_layers=True)
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    attention_layers = sum(t == "full_attention" for t in types)
    assert len(calls) == 3 * attention_layers, (len(calls), attention_layers)  # 3 segments
