"""`LongStrawGRPOTrainer` end to end on a tiny model (CPU): generation, references, refresh, checkpoints, bad input.

Loss/gradient parity with TRL is in `test_trainer_parity.py`, learning in `test_trainer_learning.py`.
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _trl_helpers import TINY_VOCAB, make_tiny_grpo_trainer, make_tiny_longstraw_trainer, tiny_model_dir
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel, Qwen3ForCausalLM
from trl import GRPOConfig

from longstraw_trl import (
    LongStrawError,
    LongStrawGRPOConfig,
    UnsupportedModelError,
    capture_prompt,
    generate_from_state,
)
from longstraw_trl.config import check_train_groups
from longstraw_trl.refresh import RefreshPolicy
from longstraw_trl.toy_tokenizer import build_toy_tokenizer
from longstraw_trl.trainer import (
    REFRESH_STATE_FILE,
    LongStrawGRPOTrainer,
    NonFiniteLossError,
    RewardFunctionError,
)

PROMPTS = ["the quick brown fox jumps over the lazy dog. " * 2, "a long straw: 1234567890 " * 3]


def _digit_reward(completions, **kwargs):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def _dataset(n=8, prompts=PROMPTS):
    return Dataset.from_dict({"prompt": [prompts[i % len(prompts)] for i in range(n)]})


# ----------------------------------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------------------------------
SAMPLING = dict(temperature=0.9, top_k=20, top_p=0.95, max_completion_length=10)


def _generate_on_one_seed(ours, stock, rows, seed: int = 3):
    """Both trainers' generation batches for `rows`, each drawn from the same seed (train mode)."""
    outputs = []
    for trainer in (ours, stock):
        trainer.model.train()
        torch.manual_seed(seed)
        outputs.append(trainer._generate_and_score_completions(rows))
    return outputs


def test_completions_equal_state_generate_and_stock_trl():
    """With one seed: the trainer's completions are `generate_from_state`'s draws, and stock GRPOTrainer's too."""
    ours = make_tiny_longstraw_trainer(**SAMPLING)
    stock = make_tiny_grpo_trainer(**SAMPLING)
    rows = [{"prompt": PROMPTS[1]}] * 4
    out, ref = _generate_on_one_seed(ours, stock, rows)
    assert torch.equal(out["completion_ids"], ref["completion_ids"])
    assert torch.equal(out["completion_mask"], ref["completion_mask"])

    prompt = torch.tensor(ours.processing_class(PROMPTS[1])["input_ids"])
    key, captured = out["longstraw_prompts"][0]
    assert torch.equal(captured, prompt)
    state = capture_prompt(ours.model, prompt)
    torch.manual_seed(3)
    raw = generate_from_state(
        state,
        ours.model,
        4,
        SAMPLING["max_completion_length"],
        temperature=0.9,
        top_k=20,
        top_p=0.95,
        eos_token_id=ours.eos_token_ids,
        pad_token_id=ours.processing_class.pad_token_id,
    )
    mask = out["completion_mask"].bool()
    width = mask.size(1)
    assert torch.equal(raw[:, :width][mask], out["completion_ids"][mask])
    # the prompt state replaces TRL's (B, P) prompt tensors
    assert "prompt_ids" not in out and ours.prompt_cache[key].state is not None


@pytest.mark.parametrize(
    "options",
    [
        dict(
            repetition_penalty=1.4,
            generation_kwargs={
                "bad_words_ids": [[5], [40, 41]],
                "no_repeat_ngram_size": 2,
                "suppress_tokens": [9],
                "begin_suppress_tokens": [10, 11],
                "min_new_tokens": 4,
            },
            **SAMPLING,
        ),
        # greedy, EOS boosted: each completion ends as soon as min_length allows, which counts TRL's left padding of
        # the shorter prompt (two groups of different lengths)
        dict(
            repetition_penalty=1.4,
            max_completion_length=10,
            generation_kwargs={"do_sample": False, "sequence_bias": [[[2], 30.0]], "min_length": 95},
        ),
    ],
    ids=["sampling-one-group", "greedy-two-groups"],
)
def test_sampling_options_reach_the_sampler_as_in_stock_trl(options, monkeypatch):
    """TRL passes these to `model.generate`; the trainer's shared-prefix sampler gets them (with the prompt and TRL's
    padded input length) and gives the same completions."""
    from longstraw_trl import generation

    seen = []

    class Spy(generation.LogitsProcessing):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append((args[5], self))

    monkeypatch.setattr(generation, "LogitsProcessing", Spy)
    ours = make_tiny_longstraw_trainer(**options)
    stock = make_tiny_grpo_trainer(**options)
    two = "min_length" in options["generation_kwargs"]
    rows = (
        [{"prompt": PROMPTS[0]}] * 4 + [{"prompt": PROMPTS[1]}] * 4 if two else [{"prompt": PROMPTS[1]}] * 4
    )
    out, ref = _generate_on_one_seed(ours, stock, rows)
    assert torch.equal(out["completion_mask"], ref["completion_mask"])
    assert torch.equal(out["completion_ids"], ref["completion_ids"])
    prompts = [
        torch.tensor(ours.processing_class(r["prompt"])["input_ids"]) for r in rows[:: ours.num_generations]
    ]
    assert [ids.tolist() for ids, _ in seen] == [p.tolist() for p in prompts]
    for _, processing in seen:
        assert processing.input_length == max(p.numel() for p in prompts) and processing.penalty == 1.4
        assert (processing.ngram is not None) == ("no_repeat_ngram_size" in options["generation_kwargs"])
    if two:  # EOS exactly where min_length (95 with the padding to the longer prompt) first allows it
        longest = len(ours.processing_class(PROMPTS[0])["input_ids"])
        assert out["completion_mask"].sum(1).tolist() == [95 - longest + 1] * 8


def test_conversational_prompts_use_the_chat_template():
    messages = [{"role": "user", "content": "where is the needle?"}]
    ours = make_tiny_longstraw_trainer(train_dataset=Dataset.from_dict({"prompt": [messages] * 4}))
    ours.model.train()
    out = ours._generate_and_score_completions([{"prompt": messages}] * 4)
    expected = ours.processing_class.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = out["longstraw_prompts"][0][1]
    assert ours.processing_class.decode(ids) == expected == "user: where is the needle?\nassistant: "


LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])


@pytest.mark.parametrize("how", ["peft_config", "peft_model"])
def test_peft_reference_has_its_own_capture(how):
    """beta != 0 with LoRA, as TRL does it: a `peft_config` trains a new adapter and the reference is the base model
    (adapters disabled); a `PeftModel` keeps its adapter and the reference is TRL's frozen "ref" copy of it. Either way
    the reference has its own capture, and old / reference log-probs equal the stock HF forward of that model."""
    if how == "peft_config":
        ours = make_tiny_longstraw_trainer(
            peft_config=LoraConfig(**LORA), beta=0.04, num_iterations=2, **SAMPLING
        )
    else:
        model = get_peft_model(Qwen3ForCausalLM.from_pretrained(tiny_model_dir()), LoraConfig(**LORA))
        ours = make_tiny_longstraw_trainer(model=model, beta=0.04, num_iterations=2, **SAMPLING)
        assert "ref" in ours.model.peft_config
    assert ours.ref_model is None
    with torch.no_grad():  # as if the policy adapter had been trained
        for name, param in ours.model.named_parameters():
            if "lora_B.default" in name:
                param.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    ours.model.train()
    torch.manual_seed(0)
    # num_iterations=2: TRL computes old log-probs too (gradient_accumulation_steps % generate_every != 0)
    out = ours._generate_and_score_completions([{"prompt": PROMPTS[0]}] * 4)
    prompt = out["longstraw_prompts"][0][1]
    ids, mask = out["completion_ids"], out["completion_mask"]
    full = torch.cat([prompt[None].expand(ids.size(0), -1), ids], dim=1)

    def stock_logps():
        with torch.no_grad():
            logits = ours.model(full).logits.float() / SAMPLING["temperature"]
        logp = torch.log_softmax(logits[:, prompt.numel() - 1 : -1], -1)
        return logp.gather(-1, ids[..., None])[..., 0] * mask

    policy = stock_logps()
    if how == "peft_config":
        with ours.model.disable_adapter():
            reference = stock_logps()
    else:
        ours.model.set_adapter("ref")
        reference = stock_logps()
        ours.model.set_adapter("default")
    assert (policy - reference).abs().max() > 1e-2  # the adapters matter
    assert (out["old_per_token_logps"] - policy).abs().max() <= 1e-4
    assert (out["ref_per_token_logps"] - reference).abs().max() <= 1e-4


@pytest.mark.parametrize("entropy_coef", [0.0, 0.1])
def test_per_token_logps_outside_a_generation_batch_are_trls(entropy_coef):
    """Called directly (as TRL's tests do), `_get_per_token_logps_and_entropies` has no prompt states to replay on: it
    gives what stock GRPOTrainer gives for the same ids (log-probs, entropies and whether these carry a graph)."""
    ours = make_tiny_longstraw_trainer(entropy_coef=entropy_coef)
    stock = make_tiny_grpo_trainer(entropy_coef=entropy_coef)
    ours.model.load_state_dict(stock.model.state_dict())
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, TINY_VOCAB, (3, 9), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    got, want = (
        t._get_per_token_logps_and_entropies(t.model, ids, mask, logits_to_keep=5, compute_entropy=True)
        for t in (ours, stock)
    )
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    assert (got[0].requires_grad, got[1].requires_grad) == (want[0].requires_grad, want[1].requires_grad)


# ----------------------------------------------------------------------------------------------------------------------
# Training loop: metrics, refresh policy, checkpoints
# ----------------------------------------------------------------------------------------------------------------------
def _train(max_steps=2, **kwargs):
    kwargs.setdefault("reward_funcs", _digit_reward)
    kwargs.setdefault("train_dataset", _dataset())
    trainer = make_tiny_longstraw_trainer(
        max_steps=max_steps, learning_rate=kwargs.pop("learning_rate", 1e-2), seed=0, **kwargs
    )
    trainer.train()
    return trainer, [h for h in trainer.state.log_history if "loss" in h]


def test_train_a_moe_policy_with_its_config_aux_loss_coefficient():
    """qwen3_moe with `router_aux_loss_coef=None` takes the config's coefficient (as TRL does); two optimizer steps
    of generation, capture (with router statistics) and streamed loss, and TRL's `aux_loss` metric is logged."""
    from _trl_helpers import tiny_qwen3_moe

    trainer, logs = _train(model=tiny_qwen3_moe(router_aux_loss_coef=0.01), max_completion_length=6)
    assert trainer.loss_spec.router_aux_loss_coef == 0.01 and trainer.router_aux is not None
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) and h["aux_loss"] >= 1.0 for h in logs)


def test_train_logs_trl_and_longstraw_metrics_with_gradient_checkpointing():
    """TRL's default gradient checkpointing on; TRL's metrics plus ours reach `log()`."""
    trainer, logs = _train(max_steps=2, activation_checkpointing=True, gradient_accumulation_steps=1)
    assert unwrap_checkpointing(trainer)
    first = logs[0]
    for name in (
        "reward",
        "reward_std",
        "completions/mean_length",
        "entropy",
        "clip_ratio/region_mean",
        "loss",
    ):
        assert name in first and math.isfinite(first[name]), name
    for name in (
        "longstraw/prompt_tokens",
        "longstraw/state_bytes/kv",
        "longstraw/live_state_bytes",
        "longstraw/peak_memory_gib",
        "longstraw/capture_peak_memory_gib",
        "longstraw/capture_seconds",
        "longstraw/generation_seconds",
        "longstraw/generation_tokens_per_second",
        "longstraw/replay_seconds",
        "longstraw/replay_tokens_per_second",
        "longstraw/refresh/fresh",
        "longstraw/refresh/interval",
    ):
        assert name in first, name
    assert first["longstraw/prompt_tokens"] == pytest.approx(
        sum(len(p) for p in PROMPTS) / 2, abs=len(PROMPTS[1])
    )
    assert all(math.isfinite(h["grad_norm"]) and h["grad_norm"] > 0 for h in logs)
    assert 0 < first["longstraw/capture_peak_memory_gib"] <= first["longstraw/peak_memory_gib"]
    assert not len(trainer.prompt_cache)  # freed after training


def unwrap_checkpointing(trainer):
    return any(getattr(m, "gradient_checkpointing", False) for m in trainer.model.modules())


def test_evaluate_generates_scores_and_frees_its_states():
    trainer = make_tiny_longstraw_trainer(
        reward_funcs=_digit_reward,
        per_device_eval_batch_size=4,
        num_generations_eval=2,
        eval_strategy="no",
    )
    metrics = trainer.evaluate(eval_dataset=_dataset(4))
    for name in ("eval_loss", "eval_reward", "eval_entropy", "eval_longstraw/prompt_tokens"):
        assert name in metrics and math.isfinite(metrics[name]), name
    assert trainer.live_state_bytes() == 0 and not len(trainer.prompt_cache)


@pytest.mark.parametrize("policy", ["recapture", "reuse", "adaptive"])
def test_refresh_policy_on_num_iterations(policy, caplog):
    """num_iterations=2: the second optimizer step reuses the generation batch, whose states are then stale."""
    caplog.set_level(logging.INFO, logger="longstraw_trl")
    trainer, logs = _train(
        max_steps=2,
        gradient_accumulation_steps=1,
        num_iterations=2,
        refresh_policy=policy,
        refresh_interval=1,
        refresh_probe_period=1,
        train_dataset=_dataset(4, PROMPTS[:1]),
    )
    first, second = logs
    assert first["longstraw/refresh/capture"] == 1 and first["longstraw/refresh/fresh"] == 1
    expected = {"recapture": "recapture", "reuse": "reuse", "adaptive": "probe"}[policy]
    assert second[f"longstraw/refresh/{expected}"] == 1
    assert second["longstraw/refresh/state_age"] == 1
    assert any("LongStraw refresh" in r.getMessage() and expected in r.getMessage() for r in caplog.records)
    if policy == "adaptive":
        assert "longstraw/refresh/drift" in second and second["longstraw/refresh/drift"] > 0
        assert trainer.refresh_policy.interval in (0, 2)  # narrowed or widened from 1


def test_refresh_policy_unit():
    reuse = RefreshPolicy("reuse", interval=2)
    assert [reuse.decide(a).action for a in (0, 1, 2, 3)] == ["fresh", "reuse", "reuse", "recapture"]
    assert [RefreshPolicy("recapture").decide(a).action for a in (0, 1)] == ["fresh", "recapture"]
    adaptive = RefreshPolicy("adaptive", interval=2, drift_threshold=0.1, probe_period=2, max_interval=3)
    assert [adaptive.decide(1).action for _ in range(4)] == ["reuse", "probe", "reuse", "probe"]
    assert adaptive.record_drift(0.01) == 3 and adaptive.record_drift(0.01) == 3  # widen, capped
    assert adaptive.record_drift(0.5) == 1 and adaptive.record_drift(0.5) == 0  # narrow
    assert adaptive.decide(1).action == "recapture"
    restored = RefreshPolicy("adaptive", interval=2, drift_threshold=0.1, probe_period=2, max_interval=3)
    restored.load_state_dict(adaptive.state_dict())
    assert restored.state_dict() == adaptive.state_dict()


def test_checkpoint_resume_gives_the_same_next_loss(tmp_path):
    """The resumed run makes the refresh decisions of the uninterrupted one, which need the checkpointed policy.

    num_iterations=2: each generation batch serves two optimizer steps; the second replays on a state one step stale.
    Three prompts, one per generation batch (one epoch), so no prompt state crosses the checkpoint (states are not
    saved). Stale uses at steps 2 (reuse), 4 (probe: drift > 0 halves the interval to 0; checkpoint) and 6: with the
    restored interval 0 step 6 re-captures, while a policy rebuilt from the config (interval 1, no stale use yet)
    would reuse the stale state, and its loss would differ.
    """
    prompts = [*PROMPTS, "needle in a haystack " * 3]
    kwargs = dict(
        output_dir=str(tmp_path),
        save_strategy="steps",
        save_steps=4,
        gradient_accumulation_steps=1,
        num_iterations=2,
        refresh_policy="adaptive",
        refresh_interval=1,
        refresh_probe_period=2,
        refresh_drift_threshold=0.0,
        train_dataset=_dataset(3, prompts),
    )
    trainer, logs = _train(max_steps=6, **kwargs)
    checkpoint = tmp_path / "checkpoint-4"
    saved = json.loads((checkpoint / REFRESH_STATE_FILE).read_text())
    assert [h["longstraw/refresh/capture"] for h in logs] == [1, 0, 1, 0, 1, 0]  # no state crosses a batch
    assert logs[3]["longstraw/refresh/probe"] == 1 and saved["interval"] == 0 and saved["stale_uses"] == 2
    assert logs[5]["longstraw/refresh/recapture"] == 1
    forgetful = RefreshPolicy("adaptive", interval=1, drift_threshold=0.0, probe_period=2)
    assert forgetful.decide(1).action == "reuse"  # what a resume that forgot the policy would do at step 6

    resumed = make_tiny_longstraw_trainer(
        max_steps=6, learning_rate=1e-2, seed=0, reward_funcs=_digit_reward, **kwargs
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))
    resumed_logs = [h for h in resumed.state.log_history if "loss" in h]
    assert [h["step"] for h in resumed_logs] == list(range(1, 7))  # 1-4: the checkpoint's trainer state
    assert resumed_logs[:4] == logs[:4]
    for before, after in zip(logs[4:], resumed_logs[4:], strict=True):
        refresh = {n for n in (*before, *after) if n.startswith("longstraw/refresh/")}
        assert {n: after.get(n) for n in refresh} == {n: before.get(n) for n in refresh}
        assert after["loss"] == pytest.approx(before["loss"], abs=1e-6)
        assert after["grad_norm"] == pytest.approx(before["grad_norm"], rel=1e-5)
    assert resumed_logs[4]["reward"] == logs[4]["reward"]  # same completions
    assert resumed.refresh_policy.state_dict() == trainer.refresh_policy.state_dict()


# ----------------------------------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------------------------------
def test_micro_batch_may_hold_part_of_a_group_not_the_generation_batch(tmp_path):
    args = LongStrawGRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=8,
        gradient_accumulation_steps=2,
        use_cpu=True,
    )
    assert args.steps_per_generation == 2
    with pytest.raises(LongStrawError, match=r"generation batch.*\(6 \* 1\).*num_generations=4"):
        check_train_groups(
            SimpleNamespace(per_device_train_batch_size=6, steps_per_generation=1, num_generations=4)
        )


def test_stock_batch_shape_with_a_group_split_over_micro_batches_trains():
    """TRL's own example shape scaled down: 2 rows a micro-batch, groups of 4, 2 micro-batches per generation."""
    trainer, logs = _train(
        max_steps=1,
        per_device_train_batch_size=2,
        num_generations=4,
        gradient_accumulation_steps=2,
        train_dataset=_dataset(4, PROMPTS[:1]),
    )
    assert logs[0]["longstraw/refresh/capture"] == 0.5  # one capture over the two micro-batches
    assert math.isfinite(logs[0]["loss"])


def test_missing_prompt_column_is_refused():
    dataset = Dataset.from_dict({"text": ["a", "b"], "answer": ["1", "2"]})
    with pytest.raises(LongStrawError, match=r"no 'prompt' column \(columns: text, answer\)"):
        make_tiny_longstraw_trainer(train_dataset=dataset)


def test_unsupported_model_is_refused():
    config = GPT2Config(vocab_size=TINY_VOCAB, n_embd=32, n_layer=1, n_head=4)
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*supported model types: .*qwen3"):
        make_tiny_longstraw_trainer(model=GPT2LMHeadModel(config))


def test_prompt_learning_peft_is_refused_as_config_and_as_wrapped_model():
    """Prompt tuning adds virtual tokens the captured prompt state never sees: refused whether it comes as
    `peft_config` or on a PEFT-wrapped model, naming the method and the adapter."""
    from peft import PromptTuningConfig
    from transformers import AutoModelForCausalLM

    tuning = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    with pytest.raises(UnsupportedModelError, match=r"PromptTuningConfig is a prompt-learning PEFT method"):
        make_tiny_longstraw_trainer(peft_config=tuning)
    wrapped = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir()), tuning)
    with pytest.raises(UnsupportedModelError, match=r"PEFT adapter 'default' \(PromptTuningConfig\)"):
        make_tiny_longstraw_trainer(model=wrapped)


def _stock_accepts(model) -> None:
    """Stock `GRPOTrainer` builds on `model` (the refusal below is LongStraw's, not the model's)."""
    from _trl_helpers import _constant_reward, _tiny_config_kwargs
    from trl import GRPOTrainer

    GRPOTrainer(
        model=model,
        reward_funcs=_constant_reward,
        args=GRPOConfig(**_tiny_config_kwargs("stock_accepts_", "dapo", 0.0)),
        train_dataset=_dataset(4, PROMPTS[:1]),
        processing_class=build_toy_tokenizer(TINY_VOCAB),
    )


def test_unwired_state_space_model_is_refused_naming_why():
    """A Mamba-2 model without a family patch (plain `mamba2`; `nemotron_h` is supported): stock trains it, LongStraw
    refuses, saying why."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    config = Mamba2Config(
        vocab_size=TINY_VOCAB, hidden_size=16, num_hidden_layers=2, num_heads=4, head_dim=8, expand=2, state_size=8,
        n_groups=1, conv_kernel=4, chunk_size=16, pad_token_id=0, eos_token_id=2, bos_token_id=1,
    )  # fmt: skip
    _stock_accepts(Mamba2ForCausalLM(config))
    with pytest.raises(
        UnsupportedModelError, match=r"'mamba2'.*Mamba-2 state.*nemotron_h.*supported model types"
    ):
        make_tiny_longstraw_trainer(model=Mamba2ForCausalLM(config))


def test_custom_code_model_is_refused_naming_why():
    """TRL's test_trust_remote_code: a Hub repo's own modeling code (`transformers_modules.*`) is refused, saying so."""
    from _trl_helpers import tiny_qwen3_config

    class RemoteConfig(type(tiny_qwen3_config())):
        model_type = "remote"

    class RemoteForCausalLM(Qwen3ForCausalLM):
        config_class = RemoteConfig

    RemoteForCausalLM.__module__ = (
        "transformers_modules.tiny_remote.modeling_remote"  # as trust_remote_code loads it
    )
    config = RemoteConfig(
        **{k: v for k, v in tiny_qwen3_config().to_diff_dict().items() if k != "model_type"}
    )
    _stock_accepts(RemoteForCausalLM(config))
    with pytest.raises(UnsupportedModelError, match=r"'remote' \(RemoteForCausalLM\).*custom modeling code"):
        make_tiny_longstraw_trainer(model=RemoteForCausalLM(config))


def test_reward_function_that_raises_is_named():
    def broken_needle_reward(completions, **kwargs):
        raise KeyError("answer")

    with pytest.raises(RewardFunctionError, match=r"reward function 'broken_needle_reward' raised KeyError"):
        _train(max_steps=1, reward_funcs=broken_needle_reward)


def test_empty_prompt_is_refused_at_construction_naming_the_row():
    prompts = Dataset.from_dict({"prompt": [PROMPTS[0], PROMPTS[1], "", PROMPTS[0]]})
    with pytest.raises(LongStrawError, match=r"train_dataset row 2: column 'prompt' is empty \(''\)"):
        make_tiny_longstraw_trainer(train_dataset=prompts)
    chats = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}], []]})
    with pytest.raises(LongStrawError, match=r"eval_dataset row 1: column 'prompt' is empty \(\[\]\)"):
        make_tiny_longstraw_trainer(eval_dataset=chats)


def test_empty_prompt_of_a_streamed_dataset_is_named_at_its_first_step():
    from datasets import IterableDataset

    def rows():
        yield from ({"prompt": p} for p in ["", "", "", "", PROMPTS[0], PROMPTS[0], PROMPTS[0], PROMPTS[0]])

    trainer = make_tiny_longstraw_trainer(
        train_dataset=IterableDataset.from_generator(rows), max_steps=2, gradient_accumulation_steps=1
    )
    with pytest.raises(
        LongStrawError, match=r"row 0 of this batch \(global step 0\): column 'prompt' \(''\)"
    ):
        trainer.train()


def _scalar_reward(completions, **kwargs):
    return 1.0


def _string_reward(completions, **kwargs):
    return ["1.0" for _ in completions]


def _short_reward(completions, **kwargs):
    return [1.0]


def _inf_reward(completions, **kwargs):
    return [float("inf") if i == 2 else 0.0 for i in range(len(completions))]


def _nan_reward(completions, **kwargs):
    return torch.tensor([0.0, 1.0, 0.5, float("nan")])


async def _async_inf_reward(completions, **kwargs):
    return [float("-inf")] + [0.0] * (len(completions) - 1)


@pytest.mark.parametrize(
    "func,match",
    [
        (
            _scalar_reward,
            r"'_scalar_reward' returned float 1.0; expected one float or None per completion \(a list of 4\)",
        ),
        (_string_reward, r"'_string_reward' returned str '1.0' for row 0; expected one float or None"),
        (_short_reward, r"'_short_reward' returned 1 values for 4 completions"),
        (_inf_reward, r"'_inf_reward' returned inf for row 2 \(completion .*\): rewards must be finite"),
        (_nan_reward, r"'_nan_reward' returned nan for row 3 .*Return None for a completion"),
        (_async_inf_reward, r"'_async_inf_reward' returned -inf for row 0"),
    ],
    ids=["scalar", "strings", "wrong_length", "inf", "nan_tensor", "async_inf"],
)
def test_reward_function_output_is_checked(func, match):
    with pytest.raises(RewardFunctionError, match=match):
        _train(max_steps=1, reward_funcs=func, gradient_accumulation_steps=1)


def test_reward_function_may_return_none_numpy_and_tensors():
    def mixed_reward(completions, **kwargs):
        values = [np.float32(1.0), None, torch.tensor(2.0), 3]
        return [values[i % 4] for i in range(len(completions))]

    _, logs = _train(max_steps=1, reward_funcs=mixed_reward, gradient_accumulation_steps=1)
    assert math.isfinite(logs[0]["loss"]) and logs[0]["reward"] > 0


def test_nan_loss_stops_training_naming_step_and_group():
    trainer = make_tiny_longstraw_trainer(
        max_steps=2,
        beta=0.04,
        reward_funcs=_digit_reward,
        train_dataset=_dataset(),
        gradient_accumulation_steps=1,
    )
    with torch.no_grad():  # a corrupt reference checkpoint
        trainer.ref_model.get_output_embeddings().weight.fill_(float("nan"))
    with pytest.raises(NonFiniteLossError, match=r"global step 1 .*group 0 .*the reference log-probs"):
        trainer.train()


@pytest.mark.parametrize(
    "kwargs,trainer_kwargs,match",
    [
        (dict(use_vllm=True), {}, "use_vllm=True"),
        (dict(generation_kwargs={"stop_strings": ["x"]}), {}, r"stop_strings.*decoded text"),
        (dict(generation_kwargs={"num_beams": 2}), {}, r"generation_kwargs\['num_beams'\].*beam search"),
        (dict(generation_kwargs={"typical_p": 0.5, "use_cache": True}), {}, r"typical_p"),
        (dict(generation_kwargs={"output_logits": True}), {}, r"generation_kwargs \['output_logits'\]"),
        (dict(top_entropy_quantile=0.5, cp_size=2), {}, "top_entropy_quantile=0.5 with cp_size=2"),
    ],
    ids=[
        "vllm",
        "stop_strings",
        "num_beams",
        "typical_p",
        "unknown_generation_kwarg",
        "entropy_quantile_cp",
    ],
)
def test_unsupported_options_are_refused(kwargs, trainer_kwargs, match, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = LongStrawGRPOConfig(
            output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, num_generations=4, **kwargs
        )
        with pytest.raises(LongStrawError, match=match):
            LongStrawGRPOTrainer(
                model=Qwen3ForCausalLM.from_pretrained(tiny_model_dir()),
                reward_funcs=_digit_reward,
                args=args,
                train_dataset=_dataset(),
                processing_class=build_toy_tokenizer(TINY_VOCAB),
                **trainer_kwargs,
            )


def test_plain_grpo_config_is_refused(tmp_path):
    with pytest.raises(TypeError, match="LongStrawGRPOConfig"):
        LongStrawGRPOTrainer(
            model=Qwen3ForCausalLM.from_pretrained(tiny_model_dir()),
            reward_funcs=_digit_reward,
            args=GRPOConfig(
                output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, num_generations=4
            ),
            train_dataset=_dataset(),
            processing_class=build_toy_tokenizer(TINY_VOCAB),
        )


def test_train_gpt_oss_with_its_config_aux_loss_coefficient():
    """GPT-OSS's HF forward computes the Switch load-balancing loss (transformers 5.23; its config declares
    `output_router_logits` and a coefficient), so TRL weights it by default: so does the trainer, exactly
    (tests/test_router_aux.py compares the shares with transformers' own function), instead of refusing it."""
    from _models import build_window
    from _trl_helpers import TINY_VOCAB

    model = build_window("gpt_oss", vocab_size=TINY_VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    coef = model.config.router_aux_loss_coef
    trainer, logs = _train(model=model, max_completion_length=6)
    assert coef > 0 and trainer.loss_spec.router_aux_loss_coef == coef and trainer.router_aux is not None
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) and h["aux_loss"] > 0 for h in logs)


@pytest.mark.parametrize("fused", [True, False])
def test_old_logprobs_equal_the_first_replays_bit_for_bit(fused, monkeypatch):
    """TRL's old-policy log-probs (a graph-free scoring pass) and the first policy replay of the same weights run the
    same forwards, with or without `autograd_fused_kernels` (its LoRA epilogue, here with a scale that is not a power of
    two, and on the GPU its norm kernels): the importance ratio of the first iteration is exactly 1, as in stock TRL."""
    from _trl_helpers import scripted_trainer
    from peft import LoraConfig

    import longstraw_trl.streamed_loss as streamed_loss

    seen = []
    real = streamed_loss.response_loss

    def recorded(spec, ctx, i, logps, old, *args, **kwargs):
        seen.append((logps.detach().clone(), old.detach().clone()))
        return real(spec, ctx, i, logps, old, *args, **kwargs)

    monkeypatch.setattr(streamed_loss, "response_loss", recorded)
    lora = LoraConfig(
        r=10, lora_alpha=7, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    trainer = scripted_trainer(False, lora, full_overrides={"autograd_fused_kernels": fused}, max_steps=1)
    trainer.train()
    assert trainer.args.num_iterations == 2 and seen
    logps, old = seen[0]
    assert torch.equal(logps, old), (logps - old).abs().max().item()
