"""The trainer's streamed per-response loss against TRL's real `GRPOTrainer._compute_loss` (CPU, fp32).

Same tiny model, same inputs (prompt, completions, advantages, old and reference log-probs, `num_items_in_batch`):
- TRL: `_compute_loss` on the stock model with the prompt path detached (the response-only reference of docs/design.md, "Correctness references":
  prompt prefilled into the stock cache under `no_grad`, each response run with autograd on a copy), then
  `backward()`;
- ours: `LongStrawGRPOTrainer.micro_batch_loss` (`longstraw_trl.streamed_loss`): capture, then per response replay + `response_loss` + backward.
The loss values must agree to 1e-5 and every parameter gradient to a relative L2 of 1e-4, for every loss type, both
importance-sampling levels, symmetric and asymmetric clipping with `delta`, and `beta` with the KL term.
"""

from __future__ import annotations

import math

import pytest
import torch
from _reference import param_grads
from _trl_helpers import (
    make_tiny_grpo_trainer,
    make_tiny_longstraw_trainer,
    patch_response_only_logps,
    random_grpo_inputs,
)

from longstraw_trl import LongStrawError
from longstraw_trl.loss import LOSS_TYPES
from longstraw_trl.state_cache import prompt_key as _prompt_key
from longstraw_trl.streamed_loss import split_by_groups

LENGTHS = [7, 3, 5, 1]  # one group of G = 4 completions, right-padded to 7
PROMPT_LEN = 24
SETTINGS = {
    "eps0.2-beta0": dict(beta=0.0, epsilon=0.2),
    "asym+delta-beta0.04": dict(beta=0.04, epsilon=0.1, epsilon_high=0.15, delta=1.3),
}
LOSS_METRICS = ("kl", "entropy", "clip_ratio", "cispo_clip_ratio", "vespo")


def _inputs(seed: int, beta: float, prompt_len: int = PROMPT_LEN):
    """TRL-shaped inputs of one group: every row shares the first row's prompt."""
    inputs, _, _ = random_grpo_inputs(LENGTHS, seed=seed, beta=beta, prompt_len=prompt_len)
    inputs["prompt_ids"] = inputs["prompt_ids"][:1].expand_as(inputs["prompt_ids"]).clone()
    return inputs


def _ours_inputs(inputs):
    prompt = inputs["prompt_ids"][0]
    ours = {k: v for k, v in inputs.items() if k not in ("prompt_ids", "prompt_mask")}
    ours["longstraw_prompts"] = [(_prompt_key(prompt), prompt)]
    return ours


def _loss_metrics(trainer):
    out = {}
    for name, values in trainer._metrics["train"].items():
        if values and name.startswith(LOSS_METRICS):
            out[name] = values[-1]
    return out


def trl_loss_and_grads(trainer, inputs, response_only: bool):
    trainer.model.train()
    trainer.model.zero_grad()
    if response_only:
        patch_response_only_logps(trainer, inputs["prompt_ids"][0])
    trainer._metrics["train"].clear()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), param_grads(trainer.model), _loss_metrics(trainer)


def ours_loss_and_grads(trainer, inputs):
    trainer.model.train()
    trainer.model.zero_grad()
    trainer._metrics["train"].clear()
    loss = trainer.micro_batch_loss(trainer.model, _ours_inputs(inputs), backward=True)
    assert not loss.requires_grad
    return loss, param_grads(trainer.model), _loss_metrics(trainer)


def assert_grads_close(got, ref, tol=1e-4):
    assert got.keys() == ref.keys() and ref
    for name in ref:
        rel = (got[name] - ref[name]).norm() / ref[name].norm().clamp_min(1e-12)
        assert rel <= tol, f"{name}: relative L2 {rel:.2e}"


def flat(grads):
    return torch.cat([g.flatten() for _, g in sorted(grads.items())])


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_streamed_loss_and_grads_match_trl(loss_type, level, setting):
    kwargs = dict(SETTINGS[setting], loss_type=loss_type, importance_sampling_level=level)
    trl = make_tiny_grpo_trainer(**kwargs)
    ours = make_tiny_longstraw_trainer(**kwargs)
    seed = LOSS_TYPES.index(loss_type) * 4 + (level == "sequence") * 2 + (setting != "eps0.2-beta0")
    inputs = _inputs(seed, kwargs["beta"])

    ref_loss, ref_grads, ref_metrics = trl_loss_and_grads(trl, inputs, response_only=True)
    loss, grads, metrics = ours_loss_and_grads(ours, inputs)

    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=0)
    assert_grads_close(grads, ref_grads)
    assert set(metrics) == set(ref_metrics)
    for name, value in ref_metrics.items():
        assert math.isclose(metrics[name], value, rel_tol=1e-4, abs_tol=1e-6) or (
            math.isnan(value) and math.isnan(metrics[name])
        ), (name, metrics[name], value)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo"])
def test_micro_batches_holding_parts_of_groups_match_trl(loss_type):
    """Three groups of 4 split into 2 micro-batches of 6 (stock TRL's `per_device_train_batch_size` need not be a
    multiple of `num_generations`): each micro-batch's loss and the accumulated gradients equal TRL's on the same rows.
    """
    trl = make_tiny_grpo_trainer(loss_type=loss_type, beta=0.04)
    ours = make_tiny_longstraw_trainer(loss_type=loss_type, beta=0.04)
    inputs, _, _ = random_grpo_inputs(LENGTHS * 3, seed=11, beta=0.04, prompt_len=PROMPT_LEN)
    prompts = inputs["prompt_ids"][::4]  # rows 4g .. 4g + 3 share prompt g
    inputs["prompt_ids"] = prompts.repeat_interleave(4, dim=0)
    batch = {k: v for k, v in inputs.items() if k not in ("prompt_ids", "prompt_mask")}
    batch["longstraw_prompts"] = [(_prompt_key(p), p) for p in prompts]
    batch["row"] = torch.arange(12)  # which rows each micro-batch got
    torch.manual_seed(3)
    chunks = split_by_groups(batch, 2)
    assert any(
        len(c["longstraw_prompts"]) > 1 and len(set(c["longstraw_row_group"].tolist())) > 1 for c in chunks
    )
    for model in (trl.model, ours.model):
        model.train()
        model.zero_grad()
    for chunk in chunks:
        rows = chunk.pop("row")
        assert len(rows) == 6
        ref_inputs = {
            k: (v[rows] if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in inputs.items()
        }
        patch_response_only_logps(trl, ref_inputs["prompt_ids"])
        ref_loss = trl._compute_loss(trl.model, ref_inputs)
        ref_loss.backward()
        loss = ours.micro_batch_loss(ours.model, chunk, backward=True)
        torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-5, rtol=0)
    assert_grads_close(param_grads(ours.model), param_grads(trl.model))


def test_hf_gradient_checkpointing_and_layer_checkpointing_keep_parity():
    """TRL turns HF gradient checkpointing on by default; the replay passes its context through the layer call."""
    trl = make_tiny_grpo_trainer(loss_type="grpo", beta=0.04)
    inputs = _inputs(99, 0.04)
    ref_loss, ref_grads, _ = trl_loss_and_grads(trl, inputs, response_only=True)
    for variant in ("hf", "engine"):
        ours = make_tiny_longstraw_trainer(
            loss_type="grpo", beta=0.04, replay_checkpoint_layers=variant == "engine"
        )
        if variant == "hf":
            ours.model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
        loss, grads, _ = ours_loss_and_grads(ours, inputs)
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=0)
        assert_grads_close(grads, ref_grads)


@pytest.mark.parametrize("prompt_len", [24, 96])
def test_cosine_response_only_vs_full_gradient(prompt_len):
    """Report the gap between the response-only gradient and TRL's full gradient (prompt path live)."""
    inputs = _inputs(5, 0.04, prompt_len)
    response_only = trl_loss_and_grads(make_tiny_grpo_trainer(beta=0.04), inputs, response_only=True)
    full = trl_loss_and_grads(make_tiny_grpo_trainer(beta=0.04), inputs, response_only=False)
    ours = ours_loss_and_grads(make_tiny_longstraw_trainer(beta=0.04), inputs)
    # the same loss value either way (the forward is the same); only the gradient differs
    torch.testing.assert_close(full[0], response_only[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours[0], full[0], atol=1e-5, rtol=0)
    a, b, c = flat(response_only[1]), flat(full[1]), flat(ours[1])
    cos_ref = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
    cos_ours = torch.nn.functional.cosine_similarity(c, b, dim=0).item()
    per_param = {
        name: torch.nn.functional.cosine_similarity(ours[1][name].flatten(), g.flatten(), dim=0).item()
        for name, g in full[1].items()
        if name in ours[1]
    }
    worst = sorted(per_param.items(), key=lambda kv: kv[1])[:3]
    print(
        f"\n[cosine] prompt_len={prompt_len}: cos(response-only, full) = {cos_ref:.4f} (TRL reference), "
        f"{cos_ours:.4f} (LongStraw trainer); |g_full| = {b.norm():.4g}, |g_resp| = {a.norm():.4g}; "
        f"lowest per-parameter: {', '.join(f'{n} {v:.3f}' for n, v in worst)}",
        flush=True,
    )
    assert math.isclose(cos_ours, cos_ref, abs_tol=1e-4)
    assert 0.0 < cos_ref < 1.0 - 1e-4  # the prompt path matters, and the two gradients are related


ENTROPY_SETTINGS = {
    "bonus": dict(entropy_coef=0.05),
    "quantile": dict(top_entropy_quantile=0.5),
    "quantile+bonus": dict(top_entropy_quantile=0.3, entropy_coef=0.08, beta=0.04),
}


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("setting", list(ENTROPY_SETTINGS))
def test_entropy_options_match_trl(setting, loss_type):
    """The entropy bonus (differentiable replay entropies) and the `top_entropy_quantile` mask (graph-free entropy
    pass) against stock `GRPOTrainer._compute_loss` on the response-only reference, whose entropies come from the same
    differentiable forward as its log-probs."""
    kwargs = dict(dict(beta=0.0), loss_type=loss_type, **ENTROPY_SETTINGS[setting])
    trl = make_tiny_grpo_trainer(**kwargs)
    ours = make_tiny_longstraw_trainer(**kwargs)
    inputs = _inputs(40 + list(ENTROPY_SETTINGS).index(setting), kwargs["beta"])
    ref_loss, ref_grads, ref_metrics = trl_loss_and_grads(trl, inputs, response_only=True)
    loss, grads, metrics = ours_loss_and_grads(ours, inputs)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=0)
    assert_grads_close(grads, ref_grads)
    assert set(metrics) == set(ref_metrics)
    for name, value in ref_metrics.items():
        assert math.isclose(metrics[name], value, rel_tol=1e-4, abs_tol=1e-6), (name, metrics[name], value)
    if "entropy_coef" in kwargs:
        assert (
            ours._metrics["train"]["entropy_coef"]
            == trl._metrics["train"]["entropy_coef"]
            == [kwargs["entropy_coef"]]
        )
    if "top_entropy_quantile" in kwargs:
        assert ours._metrics["train"]["longstraw/entropy_pass_seconds"]
        # the mask matters: without it the loss differs
        plain = make_tiny_longstraw_trainer(**{**kwargs, "top_entropy_quantile": 1.0})
        assert (ours_loss_and_grads(plain, inputs)[0] - loss).abs() > 1e-4


def test_entropy_bonus_gradient_is_the_entropy_gradient():
    """The bonus's own gradient: (loss with coef) - (loss without) equals TRL's, parameter by parameter."""
    inputs = _inputs(77, 0.0)
    diffs = []
    for make in (make_tiny_grpo_trainer, make_tiny_longstraw_trainer):
        with_bonus, without = make(entropy_coef=0.5), make(entropy_coef=0.0)
        if make is make_tiny_grpo_trainer:
            a, b = (trl_loss_and_grads(t, inputs, response_only=True)[1] for t in (with_bonus, without))
        else:
            a, b = (ours_loss_and_grads(t, inputs)[1] for t in (with_bonus, without))
        diffs.append({name: a[name] - b[name] for name in a})
    assert flat(diffs[1]).norm() > 1e-3 * flat(diffs[0]).norm() > 0
    assert_grads_close(diffs[1], diffs[0])


def test_adaptive_entropy_trajectory_matches_trl():
    """TRL's adaptive controller (`use_adaptive_entropy`) over 5 optimizer steps of 2 micro-batches: every loss, the
    applied coefficient, and the coefficient after each step, stock `GRPOTrainer` vs ours on the same micro-batches
    (entropies measured by each trainer's own forward). The target is put between the windows' entropies so that the
    coefficient moves both ways."""
    kwargs = dict(
        loss_type="grpo",
        beta=0.0,
        use_adaptive_entropy=True,
        entropy_coef=0.3,
        entropy_coef_delta=0.2,
        entropy_coef_min=0.0,
        entropy_coef_max=0.5,
        top_entropy_quantile=0.6,
        temperature=0.05,  # peaked distributions: the random tiny model is otherwise near-uniform (H ~ log V)
    )
    trl = make_tiny_grpo_trainer(**kwargs)
    ours = make_tiny_longstraw_trainer(**kwargs)
    batches = [_inputs(500 + k, 0.0) for k in range(10)]

    def run(trainer, step, target):
        trainer.args.entropy_target = target
        trainer.entropy_coef, trainer._last_world_entropy = kwargs["entropy_coef"], float("inf")
        trainer._entropy_window_stats = None
        losses, coefs, worlds = [], [], []
        for k, inputs in enumerate(batches):
            trainer.accelerator.gradient_state._set_sync_gradients(k % 2 == 1)
            losses.append(step(trainer, inputs)[0])
            if k % 2 == 1:
                coefs.append(trainer.entropy_coef)
                worlds.append(trainer._last_world_entropy)
        trainer.accelerator.gradient_state._set_sync_gradients(True)
        return losses, coefs, worlds

    def trl_step(trainer, inputs):
        return trl_loss_and_grads(trainer, inputs, response_only=True)

    _, _, worlds = run(trl, trl_step, float("inf"))
    ordered = sorted(worlds)
    assert ordered[2] - ordered[1] > 1e-4  # a target between them is not a near tie
    target = (ordered[1] + ordered[2]) / 2  # two windows at or below it, three above
    ref_losses, ref_coefs, ref_worlds = run(trl, trl_step, target)
    losses, coefs, our_worlds = run(ours, ours_loss_and_grads, target)
    for a, b in zip(losses, ref_losses, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert our_worlds == pytest.approx(ref_worlds, abs=1e-5)
    assert coefs == pytest.approx(ref_coefs, abs=1e-12)
    assert len(set(ref_coefs)) > 1 and ref_coefs != sorted(ref_coefs)  # it moved, not monotonically


# ----------------------------------------------------------------------------------------------------------------------
# MoE router load-balancing loss (TRL adds `router_aux_loss_coef * aux_loss / ga`)
# ----------------------------------------------------------------------------------------------------------------------
AUX_LENGTHS = [6, 0, 4, 2]  # one row without completion tokens: TRL still routes its prompt


def _aux_inputs(seed: int):
    inputs, _, _ = random_grpo_inputs(AUX_LENGTHS, seed=seed, prompt_len=PROMPT_LEN, max_len=6)
    inputs["prompt_ids"] = inputs["prompt_ids"][:1].expand_as(inputs["prompt_ids"]).clone()
    return inputs


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_router_aux_loss_matches_trl(loss_type):
    """qwen3_moe with the config's `router_aux_loss_coef` (TRL's default when `args.router_aux_loss_coef=None`):
    the streamed loss equals TRL's `_compute_loss` on the stock full forward (value and `aux_loss` metric), and the
    gradient equals TRL's with transformers' `load_balancing_loss_func` on the response-only forward."""
    import copy

    from _trl_helpers import tiny_qwen3_moe

    model = tiny_qwen3_moe(router_aux_loss_coef=0.3)
    kwargs = dict(loss_type=loss_type, beta=0.0)
    # fp32 forward (GRPOConfig's default bf16=True would autocast TRL's full forward, routers included, on CPU)
    trl = make_tiny_grpo_trainer(model=copy.deepcopy(model), bf16=False, **kwargs)
    assert trl.aux_loss_enabled and trl.router_aux_loss_coef == 0.3
    inputs = _aux_inputs(7)

    full_loss, _, _ = trl_loss_and_grads(trl, inputs, response_only=False)
    full_aux = trl._metrics["train"]["aux_loss"][-1]
    ref_loss, ref_grads, _ = trl_loss_and_grads(trl, inputs, response_only=True)
    ref_aux = trl._metrics["train"]["aux_loss"][-1]
    torch.testing.assert_close(ref_loss, full_loss, atol=1e-5, rtol=0)
    assert math.isclose(ref_aux, full_aux, rel_tol=1e-5)

    for variant in ("plain", "checkpoint_layers", "hf_gradient_checkpointing"):
        ours = make_tiny_longstraw_trainer(
            model=copy.deepcopy(model), replay_checkpoint_layers=variant == "checkpoint_layers", **kwargs
        )
        if variant == "hf_gradient_checkpointing":
            ours.model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
        loss, grads, _ = ours_loss_and_grads(ours, inputs)
        torch.testing.assert_close(loss, full_loss, atol=1e-5, rtol=0)
        assert math.isclose(ours._metrics["train"]["aux_loss"][-1], full_aux, rel_tol=1e-5)
        assert_grads_close(grads, ref_grads)
        assert any(".mlp.gate." in n for n in grads)  # the routers are trained by the aux loss

    # reentrant checkpointing hides the router logits' graph: refused, not silently dropped
    ours.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(LongStrawError, match="use_reentrant"):
        ours_loss_and_grads(ours, inputs)

    # the aux loss matters: without it the same trainer's gradient differs
    plain = make_tiny_longstraw_trainer(model=copy.deepcopy(model), router_aux_loss_coef=0.0, **kwargs)
    loss0, grads0, _ = ours_loss_and_grads(plain, inputs)
    assert (loss0 - full_loss).abs() > 1e-3
    gate = next(n for n in grads if n.endswith("mlp.gate.weight"))
    assert (grads0[gate] - ref_grads[gate]).norm() > 0.1 * ref_grads[gate].norm()


@pytest.mark.parametrize(("budget", "batch_sizes"), [(0, [1, 1, 1, 1]), (10, [1, 2, 1]), (8192, [4])])
def test_responses_replayed_together_keep_parity(budget, batch_sizes):
    """`replay_batch_tokens`: the rows of a group (lengths 7, 3, 5, 1) are replayed in batches of consecutive rows
    while rows x longest stays within the budget, one backward a batch; loss and gradients stay TRL's."""
    kwargs = dict(loss_type="dapo", beta=0.04, epsilon=0.2)
    trl = make_tiny_grpo_trainer(**kwargs)
    ours = make_tiny_longstraw_trainer(**kwargs, replay_batch_tokens=budget)
    inputs = _inputs(7, kwargs["beta"])
    ref_loss, ref_grads, _ = trl_loss_and_grads(trl, inputs, response_only=True)

    seen = []
    replay = ours.streamed_loss.policy_replay

    def spy(model, state, ids, mask, **kw):
        seen.append(ids.shape[0])
        return replay(model, state, ids, mask, **kw)

    ours.streamed_loss.policy_replay = spy
    loss, grads, _ = ours_loss_and_grads(ours, inputs)
    assert seen == batch_sizes
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=0)
    assert_grads_close(grads, ref_grads)


def test_replay_batch_tokens_must_not_be_negative():
    with pytest.raises(LongStrawError, match="replay_batch_tokens"):
        make_tiny_longstraw_trainer(replay_batch_tokens=-1)
