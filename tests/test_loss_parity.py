"""Per-response GRPO loss terms (`longstraw_trl.loss`) against TRL's real `GRPOTrainer._compute_loss`.

For each configuration: a real `GRPOTrainer` (tiny random model, toy tokenizer, CPU), its per-token log-prob
method patched to return a chosen tensor, TRL's loss + gradient + logged metrics, versus the sum of our
per-response terms, each back-propagated separately as the streaming trainer does.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from _trl_helpers import make_tiny_grpo_trainer, random_grpo_inputs, tiny_qwen3_config, trl_compute_loss
from transformers import Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from trl import GRPOConfig

from longstraw_trl.loss import (
    LOSS_TYPES,
    GRPOLossSpec,
    adaptive_entropy_coef,
    aggregate_metrics,
    applied_entropy_coef,
    batch_loss,
    batch_loss_context,
    high_entropy_mask,
    response_loss,
)
from longstraw_trl.toy_tokenizer import build_toy_tokenizer

ATOL = 1e-5
LENGTHS = [7, 3, 5, 1]  # B = 4 completions of different lengths, right-padded to 7
EPSILON_SETTINGS = {
    "eps0.2": dict(epsilon=0.2),
    "asym+delta": dict(epsilon=0.1, epsilon_high=0.15, delta=1.3),
}


def ours(
    trainer,
    inputs,
    logps,
    entropies,
    *,
    spec=None,
    truncate=True,
    pass_entropies=True,
    loss_mask=None,
    entropy_coef=None,
):
    """Sum of our per-response terms (each back-propagated on its own), their gradients and metrics.

    `entropy_coef`: the coefficient to apply under adaptive entropy control (TRL's controller state before its call).
    """
    spec = spec or GRPOLossSpec.from_args(trainer.args)
    mask = inputs["completion_mask"] if loss_mask is None else loss_mask
    entropy_mask = None
    if spec.top_entropy_quantile < 1.0:  # computed without gradient, as the trainer's entropy pass does
        entropy_mask = high_entropy_mask(entropies.detach(), mask, spec.top_entropy_quantile)
    ctx = batch_loss_context(
        spec,
        mask,
        num_items_in_batch=inputs["num_items_in_batch"],
        num_processes=trainer.accelerator.num_processes,
        gradient_accumulation_steps=trainer.current_gradient_accumulation_steps,
        training=trainer.model.training,
        entropy_mask=entropy_mask,
        entropy_coef=entropy_coef,
    )
    logps_leaf = logps.detach().clone().requires_grad_()
    entropies_leaf = entropies.detach().clone().requires_grad_()
    old = inputs.get("old_per_token_logps")
    ref = inputs.get("ref_per_token_logps")
    sampling = inputs.get("sampling_per_token_logps")
    is_ratio = inputs.get("importance_sampling_ratio")
    advantages = inputs["advantages"]
    total = torch.zeros(())
    metrics = []
    for i in range(mask.size(0)):
        length = max(ctx.lengths[i], 1) if truncate else mask.size(1)

        def cut(x, length=length, i=i):
            if x is None:
                return None
            row = x[i]
            return row[:length] if row.dim() == 1 and row.numel() == mask.size(1) else row

        term, response_metrics = response_loss(
            spec,
            ctx,
            i,
            cut(logps_leaf),
            cut(old),
            cut(ref),
            cut(advantages),
            sampling_logps_i=cut(sampling),
            importance_sampling_ratio_i=cut(is_ratio),
            entropies_i=cut(entropies_leaf) if pass_entropies else None,
        )
        assert term.dim() == 0
        term.backward()
        total = total + term.detach()
        metrics.append(response_metrics)
    return total, logps_leaf.grad, entropies_leaf.grad, aggregate_metrics(spec, metrics)


def assert_parity(trainer, inputs, logps, entropies, *, spec=None, loss_mask=None, check_entropy_grad=False):
    # TRL's controller state before its call (in train mode TRL updates it at the optimizer-step boundary)
    applied = applied_entropy_coef(
        trainer.entropy_coef,
        trainer._last_world_entropy,
        trainer.args.entropy_target,
        trainer.use_adaptive_entropy,
    )
    loss, grad, grad_entropies, metrics = trl_compute_loss(trainer, inputs, logps, entropies)
    assert torch.isfinite(loss)
    # A trainer-level value (TRL logs it at optimizer-step boundaries), not a loss metric.
    assert metrics.pop("entropy_coef", trainer.entropy_coef) == trainer.entropy_coef
    for truncate in (True, False):
        our_loss, our_grad, our_grad_entropies, our_metrics = ours(
            trainer,
            inputs,
            logps,
            entropies,
            spec=spec,
            truncate=truncate,
            loss_mask=loss_mask,
            entropy_coef=applied if trainer.use_adaptive_entropy else None,
        )
        torch.testing.assert_close(our_loss, loss, atol=ATOL, rtol=0)
        torch.testing.assert_close(our_grad, grad, atol=ATOL, rtol=0)
        if check_entropy_grad:
            torch.testing.assert_close(our_grad_entropies, grad_entropies, atol=ATOL, rtol=0)
        assert set(our_metrics) == set(metrics), (sorted(our_metrics), sorted(metrics))
        for name, value in metrics.items():
            assert math.isclose(our_metrics[name], value, rel_tol=1e-5, abs_tol=1e-6) or (
                math.isnan(value) and math.isnan(our_metrics[name])
            ), (name, our_metrics[name], value)
    return loss, grad


@pytest.mark.parametrize("eps_name", list(EPSILON_SETTINGS))
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_matches_trl(loss_type, level, beta, eps_name):
    trainer = make_tiny_grpo_trainer(
        loss_type=loss_type, beta=beta, importance_sampling_level=level, **EPSILON_SETTINGS[eps_name]
    )
    trainer.model.train()
    seed = (
        LOSS_TYPES.index(loss_type) * 8 + (level == "sequence") * 4 + (beta != 0) * 2 + (eps_name != "eps0.2")
    )
    inputs, logps, entropies = random_grpo_inputs(LENGTHS, seed=seed, beta=beta)
    loss, grad = assert_parity(trainer, inputs, logps, entropies)
    assert grad.abs().sum() > 0
    assert torch.all(grad[inputs["completion_mask"] == 0] == 0)


def test_clipping_is_exercised():
    """The random inputs hit both clip regions (otherwise the parity tests would not test the clipping)."""
    trainer = make_tiny_grpo_trainer(loss_type="grpo", **EPSILON_SETTINGS["asym+delta"])
    trainer.model.train()
    inputs, logps, entropies = random_grpo_inputs(LENGTHS, seed=4)
    _, _, _, metrics = trl_compute_loss(trainer, inputs, logps, entropies)
    assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0
    # ... and the two-sided clip `delta` binds on a loss token with a negative advantage.
    ratio = torch.exp(logps - inputs["old_per_token_logps"])
    negative = (inputs["advantages"] < 0)[:, None] & (inputs["completion_mask"] == 1)
    assert (ratio[negative] > EPSILON_SETTINGS["asym+delta"]["delta"]).any()


# Options beyond the loss type: each is checked for every loss type (token level) and a few at sequence level.
OPTIONS = {
    "on_policy_no_old": dict(inputs=dict(with_old=False)),
    "partial_ga_window": dict(current_ga=1),
    "eval_mode": dict(eval=True),
    "steps_per_generation": dict(
        grpo=dict(gradient_accumulation_steps=3, steps_per_generation=6), current_ga=3
    ),
    "empty_completion": dict(lengths=[6, 0, 4, 2, 5]),
    "single_token_batch": dict(lengths=[1, 1, 0, 1]),  # R == 1: TRL's metric helpers switch to per-sequence
    "num_processes_2": dict(num_processes=2),
    "no_bias_correction_kl": dict(beta=0.05, grpo=dict(use_bias_correction_kl=False)),
    "off_policy_mask": dict(grpo=dict(off_policy_mask_threshold=0.05)),
    "off_policy_mask_sampling": dict(grpo=dict(off_policy_mask_threshold=0.05), sampling=True),
    "vllm_is_token": dict(vllm_is="token", sampling=True),
    "vllm_is_sequence": dict(vllm_is="sequence", sampling=True),
    "tool_mask": dict(tool_mask=True),
    "per_token_advantages": dict(per_token_advantages=True),
    "entropy_bonus": dict(beta=0.02, grpo=dict(entropy_coef=0.03)),
    "entropy_quantile": dict(grpo=dict(top_entropy_quantile=0.4)),
    "entropy_quantile_bonus": dict(beta=0.02, grpo=dict(top_entropy_quantile=0.3, entropy_coef=0.05)),
    # `last_world_entropy` at or below the target: the coefficient applies (from +inf, TRL's start, it does not)
    "adaptive_entropy": dict(grpo=dict(use_adaptive_entropy=True, entropy_coef=0.04), last_world_entropy=0.1),
    "adaptive_entropy_off": dict(grpo=dict(use_adaptive_entropy=True, entropy_coef=0.04)),
    "adaptive_entropy_quantile": dict(
        grpo=dict(use_adaptive_entropy=True, entropy_coef=0.04, top_entropy_quantile=0.5, entropy_target=1.0),
        last_world_entropy=0.9,
    ),
    "sapo_vespo_params": dict(
        grpo=dict(
            sapo_temperature_pos=0.7,
            sapo_temperature_neg=1.3,
            vespo_k_pos=1.5,
            vespo_lambda_pos=2.5,
            vespo_k_neg=2.5,
            vespo_lambda_neg=1.5,
        )
    ),
}
OPTION_CASES = [(name, loss_type, "token") for name in OPTIONS for loss_type in LOSS_TYPES] + [
    (name, loss_type, "sequence")
    for name in (
        "vllm_is_token",
        "off_policy_mask",
        "empty_completion",
        "entropy_bonus",
        "tool_mask",
        "entropy_quantile_bonus",
        "adaptive_entropy_quantile",
    )
    for loss_type in ("grpo", "dapo", "luspo", "vespo")
]


@pytest.mark.parametrize("option,loss_type,level", OPTION_CASES)
def test_options_match_trl(option, loss_type, level):
    opt = OPTIONS[option]
    beta = opt.get("beta", 0.04)
    trainer = make_tiny_grpo_trainer(
        loss_type=loss_type, beta=beta, importance_sampling_level=level, **opt.get("grpo", {})
    )
    if opt.get("eval"):
        trainer.model.eval()
    else:
        trainer.model.train()
    if "current_ga" in opt:
        trainer.current_gradient_accumulation_steps = opt["current_ga"]
    if "last_world_entropy" in opt:
        trainer._last_world_entropy = opt["last_world_entropy"]
    if "num_processes" in opt:
        # Only `num_processes` enters the loss value (the dapo/cispo/vespo normalizer); cross-process reductions
        # of the metrics are identities on one process either way.
        trainer.accelerator = _AcceleratorWithProcesses(trainer.accelerator, opt["num_processes"])
    lengths = opt.get("lengths", LENGTHS)
    seed = OPTION_CASES.index((option, loss_type, level))
    inputs, logps, entropies = random_grpo_inputs(lengths, seed=seed, beta=beta, **opt.get("inputs", {}))
    mask = inputs["completion_mask"]
    gen = torch.Generator().manual_seed(1000 + seed)

    if opt.get("sampling"):
        base = inputs.get("old_per_token_logps", logps)
        inputs["sampling_per_token_logps"] = base + 0.3 * torch.randn(base.shape, generator=gen)
    spec = GRPOLossSpec.from_args(trainer.args)
    if opt.get("vllm_is"):
        # As `_generate_and_score_completions` builds it (mode *_truncate with clip_max=3); TRL's `_compute_loss`
        # reads `self.use_vllm`, our spec reads `args.use_vllm` (we do not launch vLLM here).
        trainer.use_vllm = True
        spec = dataclasses.replace(spec, vllm_importance_sampling_correction=True)
        diff = (inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"]) * mask
        if opt["vllm_is"] == "sequence":
            diff = diff.sum(dim=-1, keepdim=True)
        inputs["importance_sampling_ratio"] = torch.exp(diff).clamp(max=3.0)
    loss_mask = None
    if opt.get("tool_mask"):
        tool_mask = torch.ones_like(mask)
        tool_mask[0, 1:3] = 0
        tool_mask[2, 0] = 0
        inputs["tool_mask"] = tool_mask
        loss_mask = mask * tool_mask
        inputs["num_items_in_batch"] = loss_mask.sum() * 2
    if opt.get("per_token_advantages"):
        inputs["advantages"] = torch.randn(mask.shape, generator=gen)

    assert_parity(
        trainer,
        inputs,
        logps,
        entropies,
        spec=spec,
        loss_mask=loss_mask,
        check_entropy_grad=spec.entropy_bonus_enabled,
    )


@pytest.mark.parametrize("quantile", [1.0, 0.5])
def test_adaptive_entropy_coefficient_trajectory_matches_trl(quantile):
    """TRL's controller over 6 optimizer steps of 2 micro-batches (gradient_accumulation_steps=2), against ours driven
    by the same entropies: per micro-batch loss and gradient, and the coefficient after every optimizer step. The
    windows' entropies straddle the target, so the coefficient goes up (hitting `entropy_coef_max`) and down (hitting
    `entropy_coef_min`)."""
    kwargs = dict(
        use_adaptive_entropy=True,
        entropy_coef=0.02,
        entropy_target=1.0,
        entropy_coef_delta=0.015,
        entropy_coef_min=0.005,
        entropy_coef_max=0.04,
        top_entropy_quantile=quantile,
    )
    trainer = make_tiny_grpo_trainer(loss_type="grpo", beta=0.0, **kwargs)
    trainer.model.train()
    spec = GRPOLossSpec.from_args(trainer.args)
    # entropies ~ U(0, 2) * scale: two windows below the target, three above (down to the min), one below
    scales = [0.3, 0.5, 0.4, 0.6, 1.6, 1.2, 1.5, 1.8, 1.4, 1.7, 0.5, 0.6]
    coef, last, window = spec.entropy_coef, float("inf"), torch.zeros(2)
    trl_coefs, our_coefs, applied = [], [], []
    for k, scale in enumerate(scales):
        inputs, logps, entropies = random_grpo_inputs(LENGTHS, seed=300 + k)
        entropies = entropies * scale
        sync = k % 2 == 1
        trainer.accelerator.gradient_state._set_sync_gradients(sync)
        loss, grad, _, _ = trl_compute_loss(trainer, inputs, logps, entropies)

        apply_coef = applied_entropy_coef(coef, last, trainer.args.entropy_target, True)
        mask = inputs["completion_mask"]
        emask = high_entropy_mask(entropies, mask, quantile) if quantile < 1 else None
        ctx = batch_loss_context(
            spec,
            mask,
            num_items_in_batch=inputs["num_items_in_batch"],
            gradient_accumulation_steps=2,
            entropy_mask=emask,
            entropy_coef=apply_coef,
        )
        leaf = logps.clone().requires_grad_()
        total, terms = torch.zeros(()), []
        for i in range(len(LENGTHS)):
            term, metrics = response_loss(
                spec,
                ctx,
                i,
                leaf[i],
                inputs["old_per_token_logps"][i],
                None,
                inputs["advantages"][i],
                entropies_i=entropies[i],
            )
            term.backward()
            total = total + term.detach()
            terms.append(metrics)
        torch.testing.assert_close(total, loss, atol=ATOL, rtol=0)
        torch.testing.assert_close(leaf.grad, grad, atol=ATOL, rtol=0)
        window = window + torch.stack([m.bonus_entropy for m in terms]).sum(0)
        if sync:
            world = (window[0] / window[1].clamp(min=1.0)).item()
            coef = adaptive_entropy_coef(
                coef,
                world,
                entropy_target=trainer.args.entropy_target,
                entropy_coef_delta=trainer.args.entropy_coef_delta,
                entropy_coef_min=trainer.args.entropy_coef_min,
                entropy_coef_max=trainer.args.entropy_coef_max,
            )
            last, window = world, torch.zeros(2)
            trl_coefs.append(trainer.entropy_coef)
            our_coefs.append(coef)
            assert math.isclose(trainer._last_world_entropy, last, rel_tol=1e-6)
        applied.append(apply_coef)
    assert our_coefs == pytest.approx(trl_coefs, abs=1e-12)
    assert 0.04 in our_coefs and 0.005 in our_coefs  # both bounds reached
    assert applied[0] == 0.0 and any(a > 0 for a in applied)  # gated off before the first step, then on


class _AcceleratorWithProcesses:
    """The trainer's accelerator, claiming `num_processes` processes."""

    def __init__(self, accelerator, num_processes):
        self._accelerator = accelerator
        self.num_processes = num_processes

    def __getattr__(self, name):
        return getattr(self._accelerator, name)


def test_batch_loss_matches_trl_and_streams_backward():
    trainer = make_tiny_grpo_trainer(loss_type="dapo", beta=0.04, epsilon_high=0.28)
    trainer.model.train()
    inputs, logps, entropies = random_grpo_inputs(LENGTHS, seed=7, beta=0.04)
    loss, grad, _, metrics = trl_compute_loss(trainer, inputs, logps, entropies)
    spec = GRPOLossSpec.from_args(trainer.args)
    ctx = batch_loss_context(spec, inputs["completion_mask"], num_items_in_batch=inputs["num_items_in_batch"])
    leaf = logps.clone().requires_grad_()
    total, our_metrics = batch_loss(
        spec,
        ctx,
        leaf,
        inputs["old_per_token_logps"],
        inputs["ref_per_token_logps"],
        inputs["advantages"],
        entropies=entropies,
        backward=True,
    )
    assert not total.requires_grad
    torch.testing.assert_close(total, loss, atol=ATOL, rtol=0)
    torch.testing.assert_close(leaf.grad, grad, atol=ATOL, rtol=0)
    assert our_metrics.keys() == metrics.keys()


def test_float64_parity_is_tight():
    """In float64 the decomposition differs from TRL only by summation order."""
    trainer = make_tiny_grpo_trainer(loss_type="grpo", beta=0.04, importance_sampling_level="sequence")
    trainer.model.train()
    inputs, logps, entropies = random_grpo_inputs(LENGTHS, seed=11, beta=0.04, dtype=torch.float64)
    inputs["advantages"] = inputs["advantages"].double()
    loss, grad, _, _ = trl_compute_loss(trainer, inputs, logps, entropies)
    our_loss, our_grad, _, _ = ours(trainer, inputs, logps, entropies)
    torch.testing.assert_close(our_loss.double(), loss, atol=1e-12, rtol=0)
    torch.testing.assert_close(our_grad, grad, atol=1e-12, rtol=0)


def test_spec_mirrors_trainer_attributes():
    trainer = make_tiny_grpo_trainer(
        loss_type="cispo", beta=0.1, epsilon=0.3, epsilon_high=4.0, gradient_accumulation_steps=3
    )
    spec = GRPOLossSpec.from_args(trainer.args, model=trainer.model)
    assert spec.loss_type == trainer.loss_type
    assert spec.beta == trainer.beta
    assert (spec.epsilon_low, spec.epsilon_high) == (trainer.epsilon_low, trainer.epsilon_high)
    assert spec.importance_sampling_level == trainer.importance_sampling_level
    assert spec.max_completion_length == trainer.max_completion_length
    assert spec.steps_per_generation == trainer.args.steps_per_generation == 3
    assert spec.vllm_importance_sampling_correction is False
    # `epsilon_high=None` falls back to `epsilon`; a partial GRPOConfig-like object takes GRPOConfig's defaults.
    spec = GRPOLossSpec.from_args(SimpleNamespace(loss_type="grpo", epsilon=0.25, epsilon_high=None))
    assert (spec.epsilon_low, spec.epsilon_high) == (0.25, 0.25)
    assert spec.beta == GRPOConfig.beta and spec.importance_sampling_level == "token"


def test_entropy_options_need_their_batch_inputs():
    """The entropy options are supported; what each one needs from the caller is checked."""
    with pytest.raises(ValueError, match=r"top_entropy_quantile must be in \[0, 1\]"):
        GRPOLossSpec(top_entropy_quantile=1.5)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    quantile = GRPOLossSpec(top_entropy_quantile=0.5)
    with pytest.raises(ValueError, match="pass entropy_mask"):
        batch_loss_context(quantile, mask, num_items_in_batch=3)
    with pytest.raises(ValueError, match="pass entropy_mask"):
        batch_loss_context(GRPOLossSpec(), mask, num_items_in_batch=3, entropy_mask=mask.bool())
    adaptive = GRPOLossSpec(use_adaptive_entropy=True)
    assert adaptive.entropy_bonus_enabled  # even at entropy_coef=0, as TRL's `_entropy_bonus_enabled`
    with pytest.raises(ValueError, match="use_adaptive_entropy=True: pass the coefficient"):
        batch_loss_context(adaptive, mask, num_items_in_batch=3)
    ctx = batch_loss_context(adaptive, mask, num_items_in_batch=3, entropy_coef=0.0)
    with pytest.raises(ValueError, match="entropies_i"):
        response_loss(adaptive, ctx, 0, -torch.rand(3), None, None, 1.0)


def test_moe_router_aux_loss_coefficient_is_resolved_like_trl():
    """TRL's `trainer.router_aux_loss_coef`: the args' value, else the config's, counted only on a model whose config
    declares `output_router_logits` (the loss itself: tests/test_trainer_parity.py, tests/test_router_aux.py)."""
    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.001,
    )
    model = Qwen3MoeForCausalLM(config)
    assert (
        GRPOLossSpec.from_args(SimpleNamespace(router_aux_loss_coef=None), model=model).router_aux_loss_coef
        == 0.001
    )
    assert (
        GRPOLossSpec.from_args(SimpleNamespace(router_aux_loss_coef=0.0), model=model).router_aux_loss_coef
        == 0.0
    )
    assert (
        GRPOLossSpec.from_args(SimpleNamespace(router_aux_loss_coef=0.02), model=model).router_aux_loss_coef
        == 0.02
    )
    dense = Qwen3ForCausalLM(tiny_qwen3_config())
    assert (
        GRPOLossSpec.from_args(SimpleNamespace(router_aux_loss_coef=None), model=dense).router_aux_loss_coef
        == 0.0
    )


def test_invalid_inputs_are_rejected():
    spec = GRPOLossSpec(loss_type="dapo", beta=0.1)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    with pytest.raises(ValueError, match="num_items_in_batch"):
        batch_loss_context(spec, mask)
    ctx = batch_loss_context(spec, mask, num_items_in_batch=3)
    assert ctx.lengths == (2, 1)
    logps = -torch.rand(3)
    with pytest.raises(ValueError, match="reference"):
        response_loss(spec, ctx, 0, logps, None, None, 1.0)
    with pytest.raises(ValueError, match="positions"):
        response_loss(spec, ctx, 0, logps[:1], None, logps[:1], 1.0)
    with pytest.raises(ValueError, match="different GRPOLossSpec"):
        response_loss(GRPOLossSpec(loss_type="dapo"), ctx, 0, logps, None, None, 1.0)
    with pytest.raises(ValueError, match="max_completion_length"):
        GRPOLossSpec(loss_type="dr_grpo")
    with pytest.raises(ValueError, match="Unknown loss type"):
        GRPOLossSpec(loss_type="ppo")


def test_toy_tokenizer_roundtrip():
    tokenizer = build_toy_tokenizer(64)
    assert len(tokenizer) == 64
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    ids = tokenizer("the cat: 42\n")["input_ids"]
    assert len(ids) == len("the cat: 42\n") and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == "the cat: 42\n"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "user: hi\nassistant: "
