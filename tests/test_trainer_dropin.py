"""Drop-in behaviour: what a script written for `trl.GRPOTrainer` reads or calls keeps working on ours (CPU, tiny model).

- `evaluate()` alone (before any `train()`), with `num_generations_eval`, against stock `GRPOTrainer.evaluate()`;
- evaluation during training (`eval_strategy="steps"`) leaves training alone, and logs what stock TRL logs;
- every public instance attribute of a stock `GRPOTrainer` exists on ours, the key ones with the same value.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from _trl_helpers import (
    assert_updates_match,
    make_tiny_grpo_trainer,
    make_tiny_longstraw_trainer,
    tiny_model_dir,
    train_stock_and_full,
)
from datasets import Dataset
from transformers import TrainerCallback

from longstraw_trl import LongStrawError

PROMPTS = ["hello world", "the cat sat", "on the mat", "long straw"]
# Values that depend on wall-clock time or on the implementation, not on the training semantics.
UNTIMED = ("_runtime", "_per_second", "model_preparation_time", "step_time")


def _length_reward(completions, **kwargs):
    return [float(len(c) % 5) for c in completions]


def _comparable(metrics: dict) -> dict:
    return {
        name: value
        for name, value in metrics.items()
        if not any(tag in name for tag in UNTIMED) and "longstraw/" not in name
    }


def _assert_same_metrics(ours: dict, stock: dict, rel: float = 1e-4, abs_: float = 1e-5):
    ours, stock = _comparable(ours), _comparable(stock)
    assert set(ours) == set(stock), (sorted(set(ours) ^ set(stock)),)
    for name, value in stock.items():
        assert math.isclose(ours[name], value, rel_tol=rel, abs_tol=abs_), (name, ours[name], value)


# ----------------------------------------------------------------------------------------------------------------------
# evaluate()
# ----------------------------------------------------------------------------------------------------------------------
EVAL = dict(
    per_device_eval_batch_size=2,  # one group per eval batch: the sampler draws like stock generate
    num_generations_eval=2,  # != num_generations (4)
    temperature=0.9,
    max_completion_length=10,
    reward_funcs=_length_reward,
    entropy_coef=0.05,  # a non-zero eval loss (the sampled completions all run to max length: on-policy it is 0)
    bf16=False,
)


def test_evaluate_on_a_fresh_trainer():
    """`evaluate()` before `train()` runs without `current_gradient_accumulation_steps`, which only the training loop
    sets (stock TRL reads it in train mode only)."""
    trainer = make_tiny_longstraw_trainer(per_device_eval_batch_size=4, num_generations_eval=2)
    del trainer.current_gradient_accumulation_steps  # set by the helper, not by the constructor
    metrics = trainer.evaluate(eval_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    assert math.isfinite(metrics["eval_loss"]) and math.isfinite(metrics["eval_entropy"])


def test_evaluate_refuses_eval_batches_that_split_a_group():
    trainer = make_tiny_longstraw_trainer(per_device_eval_batch_size=3, num_generations_eval=2)
    with pytest.raises(
        LongStrawError, match=r"per_device_eval_batch_size=3 is not a multiple of num_generations_eval=2"
    ):
        trainer.evaluate(eval_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    trainer = make_tiny_longstraw_trainer(per_device_eval_batch_size=4, num_generations_eval=2)
    with pytest.raises(LongStrawError, match=r"eval_dataset has no 'prompt' column"):
        trainer.evaluate(eval_dataset=Dataset.from_dict({"text": PROMPTS}))


def test_evaluate_before_train_matches_stock_trl():
    """A freshly built trainer: `evaluate()` works (today's crash: `current_gradient_accumulation_steps` is only set by
    the training loop) and logs what stock `GRPOTrainer.evaluate()` logs on the same seed, with `eval_` keys, from
    `num_generations_eval` completions per prompt; nothing reaches the training metrics."""
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    results = []
    for make in (make_tiny_grpo_trainer, make_tiny_longstraw_trainer):
        trainer = make(**EVAL)
        # the helpers set it for `_compute_loss`-level tests; a trainer that has not trained has none
        del trainer.current_gradient_accumulation_steps
        torch.manual_seed(11)
        results.append((trainer, trainer.evaluate(eval_dataset=dataset)))
    (stock, stock_metrics), (ours, metrics) = results
    assert not hasattr(ours, "current_gradient_accumulation_steps")
    assert all(name.startswith("eval_") or name == "epoch" for name in metrics)
    assert metrics["eval_loss"] != 0.0 and metrics["eval_reward_std"] > 0  # non-trivial values compared
    _assert_same_metrics(metrics, stock_metrics)
    assert ours._metrics["train"] == {} and not len(ours.prompt_cache)
    # num_generations_eval: 2 completions per prompt (4 prompts), in groups of 2
    assert len(ours._logs["completion"]) == len(stock._logs["completion"]) == 2 * len(PROMPTS)
    assert list(ours._logs["completion"]) == list(stock._logs["completion"])


class _TrainingStateProbe(TrainerCallback):
    """Snapshots what evaluation must not touch, right before each evaluation during training."""

    def __init__(self):
        self.trainer = None
        self.checks = 0

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        self.before = dict(
            buffered=t._buffered_inputs,
            buffered_ids=[b["completion_ids"].clone() for b in t._buffered_inputs],
            step=t._step,
            train_keys=set(t.prompt_states.train_keys),
            states={k: e.state for k, e in t.prompt_cache.entries.items()},
            controller=(t.entropy_coef, t._last_world_entropy, t._entropy_window_stats),
            training=t.model.training,
        )

    def on_evaluate(self, args, state, control, **kwargs):
        t, before = self.trainer, self.before
        assert t._buffered_inputs is before["buffered"]
        for b, ids in zip(t._buffered_inputs, before["buffered_ids"], strict=True):
            assert torch.equal(b["completion_ids"], ids)
        assert t._step == before["step"] and t.prompt_states.train_keys == before["train_keys"]
        assert {k: e.state for k, e in t.prompt_cache.entries.items()} == before[
            "states"
        ]  # the training batch's states kept
        # logging_steps=1: the step's training metrics were logged (and cleared) just before; evaluation adds none
        assert not any(t._metrics["train"].values())
        assert (t.entropy_coef, t._last_world_entropy, t._entropy_window_stats) == before["controller"]
        self.checks += 1


TRAIN = dict(
    max_steps=4,
    gradient_accumulation_steps=1,
    num_iterations=2,  # the second step of each generation batch replays on the states kept across the evaluation
    refresh_policy="reuse",
    learning_rate=1e-2,
    seed=0,
    generation_kwargs={
        "do_sample": False
    },  # greedy: evaluation draws no random numbers, so runs are comparable
    max_completion_length=8,
    entropy_coef=0.05,
    use_adaptive_entropy=True,
    entropy_target=10.0,  # the adaptive coefficient applies and grows from the second step on
    top_entropy_quantile=0.5,  # in training and in evaluation
    reward_funcs=_length_reward,
    per_device_eval_batch_size=4,
    num_generations_eval=2,
    bf16=False,
)
EVAL_STEPS = dict(eval_strategy="steps", eval_steps=1)


def _train(make, **kwargs):
    callbacks = kwargs.pop("callbacks", None)
    trainer = make(
        train_dataset=Dataset.from_dict({"prompt": PROMPTS[:2]}),
        eval_dataset=Dataset.from_dict({"prompt": PROMPTS[2:]}),
        callbacks=callbacks,
        **kwargs,
    )
    if callbacks:
        callbacks[0].trainer = trainer
    trainer.train()
    history = trainer.state.log_history
    return trainer, [h for h in history if "loss" in h], [h for h in history if "eval_loss" in h]


def test_evaluation_during_training_leaves_training_alone():
    """`eval_strategy="steps"`, `eval_steps=1`: evaluation (its own captures, `num_generations_eval`) between the
    optimizer steps changes nothing the training step reads (checked at each evaluation), so the training logs are
    those of the same run without evaluation, and the reused prompt states are still reused."""
    probe = _TrainingStateProbe()
    ours, logs, eval_logs = _train(make_tiny_longstraw_trainer, callbacks=[probe], **TRAIN, **EVAL_STEPS)
    _, plain_logs, no_eval = _train(make_tiny_longstraw_trainer, **TRAIN)
    assert probe.checks == 4 and len(eval_logs) == 4 and not no_eval
    assert [h["longstraw/refresh/reuse"] for h in logs] == [0, 1, 0, 1]
    assert len(logs) == len(plain_logs) == 4
    for with_eval, without in zip(logs, plain_logs, strict=True):
        _assert_same_metrics(with_eval, without, rel=1e-6, abs_=1e-7)
    assert logs[-1]["entropy_coef"] > TRAIN["entropy_coef"]  # the adaptive controller ran (in training only)
    for h in eval_logs:
        assert all(name.startswith("eval_") or name in ("epoch", "step") for name in h)


def test_evaluation_during_training_matches_stock_trl():
    """The same run (learning rate 0, so the two trainers' weights stay equal) through stock `GRPOTrainer`: every
    training and evaluation value it logs, ours logs too, with the same value."""
    kwargs = {**TRAIN, **EVAL_STEPS, "learning_rate": 0.0}
    _, logs, eval_logs = _train(make_tiny_longstraw_trainer, **kwargs)
    kwargs.pop("refresh_policy")  # LongStraw's own option
    _, stock_logs, stock_eval = _train(make_tiny_grpo_trainer, **kwargs)
    assert len(logs) == len(stock_logs) == 4 and len(eval_logs) == len(stock_eval) == 4
    for a, b in zip(logs + eval_logs, stock_logs + stock_eval, strict=True):
        # the gradient is the response-only one (docs/design.md, "Objective"): its norm is not TRL's
        if (
            "grad_norm" in b
        ):  # (zero at step 1: the adaptive coefficient applies from step 2, advantages are 0)
            assert (a.pop("grad_norm") > 0) == (b.pop("grad_norm") > 0)
        _assert_same_metrics(a, b)


# ----------------------------------------------------------------------------------------------------------------------
# Public attributes
# ----------------------------------------------------------------------------------------------------------------------
# Stock attributes ours cannot have, with why. (None today.)
ATTRIBUTE_ALLOW_LIST: dict[str, str] = {}
KEY_ATTRIBUTES = (
    "eos_token_ids",
    "num_generations",
    "num_generations_eval",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_completion_length",
    "num_iterations",
    "beta",
    "epsilon_low",
    "epsilon_high",
    "loss_type",
    "importance_sampling_level",
    "scale_rewards",
    "mask_truncated_completions",
    "entropy_coef",
    "top_entropy_quantile",
    "use_adaptive_entropy",
    "aux_loss_enabled",
    "generation_kwargs",
    "reward_func_names",
    "chat_template_kwargs",
    "use_vllm",
    "tools",
    "rollout_func",
    "environment_factories",
)


def _public(trainer) -> set[str]:
    return {name for name in vars(trainer) if not name.startswith("_")}


@pytest.mark.parametrize("when", ["constructed", "from_path", "trained"])
def test_public_attributes_of_stock_trl_exist(when):
    """Every public instance attribute of a stock `GRPOTrainer` on the same model and config exists on ours (a
    callback or `rollout_func`-style code reads e.g. `trainer.eos_token_ids`), and the key ones are equal."""
    kwargs = dict(
        entropy_coef=0.01, top_entropy_quantile=0.8, temperature=0.7, top_k=5, beta=0.04, bf16=False
    )
    if when == "trained":
        kwargs.update(max_steps=1, learning_rate=0.0)
    stock = make_tiny_grpo_trainer(**kwargs)
    if when == "from_path":  # TRL loads the model itself
        kwargs["model"] = tiny_model_dir()
    ours = make_tiny_longstraw_trainer(**kwargs)
    for trainer in (stock, ours):
        del trainer.current_gradient_accumulation_steps  # set by the helpers, not by the constructor
        if when == "trained":
            trainer.train()
    missing = _public(stock) - _public(ours) - set(ATTRIBUTE_ALLOW_LIST)
    assert not missing, f"public GRPOTrainer attributes missing on LongStrawGRPOTrainer: {sorted(missing)}"
    assert set(KEY_ATTRIBUTES) <= _public(stock)
    for name in KEY_ATTRIBUTES:
        assert getattr(ours, name) == getattr(stock, name), name
    # the pad token TRL generates and pads with (it has no `pad_token_id` attribute of its own)
    assert ours.processing_class.pad_token_id == stock.processing_class.pad_token_id
    assert ours.generation_kwargs["pad_token_id"] == stock.generation_kwargs["pad_token_id"]
    assert ours.generation_config.to_dict() == stock.generation_config.to_dict()
    if when == "trained":
        assert ours.current_gradient_accumulation_steps == stock.current_gradient_accumulation_steps


def test_adaptive_entropy_controller_is_checkpointed(tmp_path):
    """TRL saves its controller (`entropy_ctrl_state.json`) and restores it on resume; ours keeps TRL's attributes,
    so the same files carry it: the resumed trainer starts from the checkpoint's coefficient, not the config's."""
    kwargs = dict(
        output_dir=str(tmp_path),
        max_steps=2,
        save_strategy="steps",
        save_steps=1,
        gradient_accumulation_steps=1,
        use_adaptive_entropy=True,
        entropy_coef=0.05,
        entropy_target=10.0,  # every step raises the coefficient
        learning_rate=1e-2,
        seed=0,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS[:2]}),
    )
    trainer = make_tiny_longstraw_trainer(**kwargs)
    trainer.train()
    saved = json.loads((tmp_path / "checkpoint-1" / "entropy_ctrl_state.json").read_text())
    assert saved["entropy_coef"] == pytest.approx(0.055) and math.isfinite(saved["last_world_entropy"])
    assert trainer.entropy_coef == pytest.approx(0.06)
    resumed = make_tiny_longstraw_trainer(**kwargs)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    # a resume that rebuilt the controller from the config would end at 0.055, and apply nothing at step 2
    assert resumed.entropy_coef == pytest.approx(0.06)
    last, resumed_last = trainer.state.log_history[-2], resumed.state.log_history[-2]
    assert last["step"] == resumed_last["step"] == 2
    assert resumed_last["loss"] == pytest.approx(last["loss"], abs=1e-6) and last["loss"] != 0.0


# the G = 4 draws of every group, one truncated: no EOS (2) within max_completion_length=4
TRUNCATED_DRAWS = [[5, 9, 11, 2], [6, 12, 13, 14], [7, 13, 2], [8, 2]]


def _truncated_draws(n: int) -> torch.Tensor:
    rows = [TRUNCATED_DRAWS[i % len(TRUNCATED_DRAWS)] for i in range(n)]
    out = torch.zeros(n, 4, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row)
    return out


def test_generation_mixin_patch_and_mask_truncated_completions_train_as_stock_trl():
    """TRL's own tests script completions by patching transformers' `GenerationMixin.generate` (e.g. its
    `test_train_with_mask_truncated_completions`): ours draws through it too, and with `mask_truncated_completions`
    the truncated draw is masked and `train()` updates the weights exactly as stock does."""
    start, stock_weights, ours = train_stock_and_full(
        draws=_truncated_draws,
        patch_generation_mixin=True,
        mask_truncated_completions=True,
        max_completion_length=4,
        loss_type="dapo",
        max_steps=1,
        num_iterations=1,
        beta=0.0,
    )
    (log,) = [h for h in ours.state.log_history if "loss" in h]
    assert log["completions/clipped_ratio"] == 0.25  # the truncated draw, masked out of the loss
    assert_updates_match(start, stock_weights, ours)
