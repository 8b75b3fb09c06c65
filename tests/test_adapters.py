"""Adapters in the model's dtype during graph-free passes (``longstraw_trl.adapters``)."""

from __future__ import annotations

import pytest
import torch
from _models import build
from _reference import VOCAB
from peft import LoraConfig, get_peft_model

from longstraw_trl import LongStrawError, capture_prompt, replay_logprobs
from longstraw_trl.adapters import adapters_in_model_dtype

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora(model, seed: int = 1, scale: float = 0.05):
    """LoRA on every linear layer; B random, of std ``scale`` (PEFT starts it at zero, which would hide the adapter)."""
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return peft_model


def _kv(state) -> torch.Tensor:
    return torch.cat(
        [
            torch.cat([k.flatten(), v.flatten()])
            for layer in state.layers.values()
            for k, v in layer.stream("cpu")
        ]
    )


def test_casts_inside_and_restores_the_same_tensors():
    model = _lora(build("qwen3").to(torch.bfloat16))
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    assert params and all(p.dtype == torch.float32 for p in params)  # PEFT's upcast
    before = [(p.data.data_ptr(), p.detach().clone()) for p in params]
    with torch.no_grad(), adapters_in_model_dtype(model) as n:
        assert n == len(params)
        assert all(p.dtype == torch.bfloat16 for p in params)
    for p, (ptr, value) in zip(params, before, strict=False):
        assert p.dtype == torch.float32 and p.data.data_ptr() == ptr and torch.equal(p, value)


def test_nothing_to_cast_and_no_autograd():
    fp32 = _lora(build("qwen3"))
    with torch.no_grad(), adapters_in_model_dtype(fp32) as n:
        assert n == 0
    with adapters_in_model_dtype(fp32, enabled=False) as n:  # disabled: allowed under autograd
        assert n == 0
    with pytest.raises(LongStrawError, match="graph-free"):
        with adapters_in_model_dtype(_lora(build("qwen3").to(torch.bfloat16))):
            pass


def test_capture_error_stays_at_bf16_level():
    """The cast's capture differs from PEFT's exact bf16 capture by no more than that one differs from fp32."""
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3))
    truth = _lora(build("qwen3"))
    model = _lora(build("qwen3").to(torch.bfloat16))
    with torch.no_grad():
        exact32 = _kv(capture_prompt(truth, prompt, chunk_size=16))
        peft16 = _kv(capture_prompt(model, prompt, chunk_size=16)).float()
        with adapters_in_model_dtype(model) as n:
            assert n > 0
            cast16 = _kv(capture_prompt(model, prompt, chunk_size=16)).float()
    assert not torch.equal(cast16, peft16)  # the cast did change the computation
    err_peft = (peft16 - exact32).norm() / exact32.norm()
    err_cast = (cast16 - exact32).norm() / exact32.norm()
    assert err_peft < 2e-2
    print(f"capture rel. error vs fp32: PEFT bf16 {err_peft:.2e}, cast {err_cast:.2e}")
    assert err_cast < 1.5 * err_peft, (err_cast, err_peft)


@pytest.mark.parametrize("enabled", [True, False])
def test_trainer_casts_in_capture_and_generation_only(enabled, monkeypatch):
    from _trl_helpers import make_tiny_longstraw_trainer, tiny_model_dir
    from transformers import Qwen3ForCausalLM

    import longstraw_trl.prompt_state_manager as trainer_module
    import longstraw_trl.rollout as rollout_module

    model = Qwen3ForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.bfloat16)
    trainer = make_tiny_longstraw_trainer(
        model=model,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        graph_free_adapters_in_model_dtype=enabled,
    )
    params = [p for n, p in trainer.model.named_parameters() if "lora_" in n]
    assert params and all(p.dtype == torch.float32 for p in params)
    seen = {}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            seen[name] = {p.dtype for p in params}
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(trainer_module, "capture_prompt", spy("capture", trainer_module.capture_prompt))
    state = trainer.prompt_states.capture(trainer.model, torch.tensor([3, 4, 5, 6]))
    monkeypatch.setattr(
        rollout_module, "generate_from_state", spy("generate", rollout_module.generate_from_state)
    )
    completions = trainer.rollout.sample_group(state, 2)
    spy("logprobs", replay_logprobs)(
        state, trainer.model, completions
    )  # scoring, outside capture and generation
    cast = torch.bfloat16 if enabled else torch.float32
    assert seen == {"capture": {cast}, "generate": {cast}, "logprobs": {torch.float32}}
    assert all(p.dtype == torch.float32 for p in params)


def test_fused_lora_forwards_equal_peft_and_are_restored():
    """Plain LoRA layers add their update in one GEMM epilogue inside the block: same outputs as PEFT's forward
    (fp32: to rounding), every adapted layer fused, PEFT's forward back afterwards; dropout > 0 is not fused."""
    from longstraw_trl.adapters import fused_lora_forwards

    model = _lora(build("qwen3"))
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    adapted = [m for m in model.modules() if hasattr(m, "lora_A") and len(m.lora_A)]
    with torch.no_grad():
        ref = model(ids).logits
        with fused_lora_forwards(model) as n:
            assert n == len(adapted) > 0
            assert all("forward" in m.__dict__ for m in adapted)
            got = model(ids).logits
    assert not any("forward" in m.__dict__ for m in adapted)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)

    dropped = get_peft_model(build("qwen3"), LoraConfig(r=4, lora_dropout=0.1, target_modules=TARGETS))
    with torch.no_grad(), fused_lora_forwards(dropped) as n:
        assert n == 0
    with pytest.raises(LongStrawError, match="graph-free"):
        with fused_lora_forwards(model):
            pass


@pytest.mark.parametrize("autocast", [False, True])
def test_differentiable_fused_lora_forwards_train_as_peft(autocast):
    """Under autograd (`differentiable=True`, what the loss binds for a micro-batch) plain LoRA layers add their update
    with one out-of-place `addmm`: logits and every adapter parameter's gradient equal PEFT's (fp32 to rounding; under
    CPU bf16 autocast to bf16 rounding), also through HF's non-reentrant checkpointing, whose recompute takes the same
    path inside the block; nested blocks leave the outer binding in place."""
    from longstraw_trl.adapters import bind_autocast_lora_inputs, fused_lora_forwards

    model = _lora(build("qwen3"), seed=6, scale=0.3)  # large adapters: their path shows in every output
    gen = torch.Generator().manual_seed(6)
    bind_autocast_lora_inputs(model)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, VOCAB, (2, 9), generator=gen)
    weights = torch.randn(2, 9, VOCAB, generator=gen)
    adapted = [m for m in model.modules() if hasattr(m, "lora_A") and len(m.lora_A)]
    trained = [p for p in model.parameters() if p.requires_grad]

    def grads(fused: bool, autocast: bool = autocast):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with fused_lora_forwards(model, fused, differentiable=True) as n:
                assert n == (len(adapted) if fused else 0)
                assert all(("forward" in m.__dict__) == fused for m in adapted)
                with fused_lora_forwards(model, fused, differentiable=True) as inner:
                    assert inner == 0  # an outer binding stands (and without one, nothing is bound)
                    logits = model(ids).logits
                assert all(("forward" in m.__dict__) == fused for m in adapted)
                (
                    logits.float() * weights
                ).sum().backward()  # the checkpoint's recompute, inside the outer block
        assert not any("forward" in m.__dict__ for m in adapted)
        return logits.detach().float(), [p.grad.clone() for p in trained]

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    ref_logits, ref = grads(False)
    got_logits, got = grads(True)
    if not autocast:
        assert rel(got_logits, ref_logits) <= 1e-5
        assert all(rel(g, r) <= 1e-5 for g, r in zip(got, ref, strict=True))
    else:  # within twice PEFT's own bf16 error of the fp32 result (the update is rounded once, PEFT's thrice)
        exact_logits, exact = grads(False, autocast=False)
        assert rel(got_logits, exact_logits) <= 2 * rel(ref_logits, exact_logits)
        assert sum(rel(g, e) for g, e in zip(got, exact, strict=True)) <= 2 * sum(
            rel(r, e) for r, e in zip(ref, exact, strict=True)
        )


def test_fused_lora_forward_scores_as_it_trains_under_autocast():
    """fp32 adapters on a model under bf16 autocast (TRL's default, `bf16=True`): the bound epilogue gives a graph-free
    scoring pass the values a replay under autograd gets, bit for bit (both one autocast `addmm`), where PEFT's forward
    rounds its update three times."""
    from longstraw_trl.adapters import bind_autocast_lora_inputs, fused_lora_forwards

    model = _lora(build("qwen3"), seed=9, scale=0.3)  # large adapters: their path shows in every output
    gen = torch.Generator().manual_seed(9)
    bind_autocast_lora_inputs(model)
    ids = torch.randint(0, VOCAB, (2, 9), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16), fused_lora_forwards(model, differentiable=True):
        trained = model(ids).logits
        with torch.no_grad():
            scored = model(ids).logits
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        peft = model(ids).logits
    assert torch.equal(scored, trained.detach())
    assert not torch.equal(peft, scored)  # PEFT's rounding differs: the comparison above means something


def test_fused_lora_forward_steps_aside_for_adapters_switched_after_binding():
    """A bound epilogue whose adapters are disabled afterwards (TRL's reference pass: `disable_adapter()` inside a pass
    already bound) runs PEFT's forward: the base model's logits, not the adapted ones."""
    from longstraw_trl.adapters import fused_lora_forwards

    model = _lora(build("qwen3"), seed=8, scale=0.3)  # large adapters: their path shows in every output
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(0, VOCAB, (2, 9), generator=gen)
    with torch.no_grad():
        with model.disable_adapter():
            base = model(ids).logits
        with fused_lora_forwards(model) as n:
            assert n > 0
            adapted = model(ids).logits
            with model.disable_adapter():
                got = model(ids).logits
    assert (adapted - base).abs().max() > 1e-3  # the adapters matter here
    torch.testing.assert_close(got, base, rtol=0, atol=0)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_expert_lora_multiplies_activations_and_equals_peft(implementation):
    """LoRA on a MoE block's fused expert weights (PEFT's ``ParamWrapper``, what "all-linear" gives GLM-5): inside
    the block the experts run with the low-rank factors applied to the activations, never forming the adapted
    weights; the logits equal PEFT's forward (fp32, the model's own experts implementation as reference), the
    adapters matter (nonzero B), and PEFT's forward is back afterwards."""
    from _models import build_glm_dsa

    from longstraw_trl.adapters import fused_lora_forwards

    base = build_glm_dsa(index_topk=6)
    base.config._experts_implementation = implementation
    model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    wrappers = [m for m in model.modules() if type(m).__name__ == "ParamWrapper"]
    experts_wrappers = [m for m in wrappers if getattr(m, "num_experts", 1) > 1]
    assert experts_wrappers, "peft no longer wraps the fused expert weights"
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in wrappers:  # (peft initialises B to zero: the update would vanish)
            for p in m.lora_B.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    ids = torch.randint(0, 97, (2, 11), generator=gen)
    outer = [m for m in experts_wrappers if type(m.base_layer).__name__ == "ParamWrapper"]
    with torch.no_grad():
        ref = model(ids).logits
        with model.disable_adapter():
            without = model(ids).logits
        with fused_lora_forwards(model) as n:
            assert outer and all("forward" in m.__dict__ for m in outer)
            assert n >= len(outer)
            got = model(ids).logits
    assert not any("forward" in m.__dict__ for m in wrappers)
    assert (ref - without).abs().max() > 1e-2  # the expert adapters change the output
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_bound_expert_lora_trains_as_peft_and_steps_aside_when_disabled():
    """Bound for good (what the trainer does), the activation-form experts give PEFT's logits and the same
    gradients of every adapter parameter (fp32), also with HF gradient checkpointing (its recompute takes the same
    path); with the adapters disabled (TRL's reference pass) PEFT's forward runs: the base model's logits."""
    from _models import build_glm_dsa

    from longstraw_trl.adapters import bind_expert_adapters

    def lora_glm():
        torch.manual_seed(0)
        model = get_peft_model(
            build_glm_dsa(index_topk=6), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
        )
        gen = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for m in model.modules():
                if type(m).__name__ == "ParamWrapper":
                    for p in m.lora_B.parameters():
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        return model

    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(6))
    weights = torch.randn(2, 13, 97, generator=torch.Generator().manual_seed(7))
    results = []
    for bind in (False, True):
        model = lora_glm()
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        if bind:
            assert bind_expert_adapters(model) == 2  # one chain a MoE block
        wrappers = [m for m in model.modules() if type(m).__name__ == "ParamWrapper"]
        assert sum("forward" in m.__dict__ for m in wrappers) == (2 if bind else 0)
        logits = model(ids).logits
        (logits * weights).sum().backward()
        grads = {
            n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None and "lora_" in n
        }
        with torch.no_grad(), model.disable_adapter():
            base = model(ids).logits
        results.append((logits.detach(), grads, base))
    (ref, ref_grads, ref_base), (got, got_grads, got_base) = results
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_base, ref_base, rtol=1e-6, atol=1e-6)
    expert_grads = [n for n in ref_grads if ".experts." in n]
    assert expert_grads and set(got_grads) == set(ref_grads)
    for name, g in ref_grads.items():
        err = float((got_grads[name] - g).norm() / g.norm().clamp_min(1e-30))
        assert err <= 1e-5, (name, err, float(g.norm()))


class _CastCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts dtype conversions to fp32 (``aten._to_copy`` with ``dtype=float32``)."""

    def __init__(self):
        super().__init__()
        self.to_fp32 = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.float32:
            self.to_fp32 += 1
        return func(*args, **kwargs)


def _forward_backward(model, ids, autocast: bool):
    model.zero_grad(set_to_none=True)
    counter = _CastCounter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), counter:
        logits = model(ids).logits
        logits.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads, counter.to_fp32


@pytest.mark.parametrize("autocast", [True, False])
def test_autocast_lora_inputs_are_bit_exact_and_skip_the_round_trip(autocast):
    """Under autocast the bound LoRA layers skip PEFT's fp32 copy of a bf16 input (autocast casts it straight back):
    logits and every gradient bit for bit PEFT's, with fewer fp32 casts; without autocast PEFT's cast stays."""
    import copy

    from longstraw_trl.adapters import bind_autocast_lora_inputs

    peft_model = _lora(build("qwen3").to(torch.bfloat16))
    bound_model = copy.deepcopy(peft_model)
    assert bind_autocast_lora_inputs(bound_model) == sum(
        1 for m in peft_model.modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A")
    )
    assert bind_autocast_lora_inputs(bound_model) == 0  # idempotent
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    ref_logits, ref_grads, ref_casts = _forward_backward(peft_model, ids, autocast)
    logits, grads, casts = _forward_backward(bound_model, ids, autocast)
    assert torch.equal(logits, ref_logits)
    assert ref_grads.keys() == grads.keys() and any("lora_A" in n for n in grads)
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name
    if autocast:
        assert casts < ref_casts, (casts, ref_casts)
    else:
        assert casts == ref_casts


def test_autocast_lora_inputs_survive_deepcopy():
    import copy

    from longstraw_trl.adapters import bind_autocast_lora_inputs

    model = _lora(build("qwen3").to(torch.bfloat16))
    bind_autocast_lora_inputs(model)
    clone = copy.deepcopy(model)
    layer = next(m for m in clone.modules() if "_cast_input_dtype" in m.__dict__)
    assert layer._cast_input_dtype.__self__ is layer
