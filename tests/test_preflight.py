"""The trainer's checks before any capture (CPU, tiny model): the pre-flight plan of the first generation batch
(`offload_prompt_state="auto"`, refusals that name what would fit, the opt-out), prompts against the model's
positions at construction and before a capture, and the objective stated at construction."""

from __future__ import annotations

import json
import logging
import os

import pytest
from _trl_helpers import make_tiny_longstraw_trainer, tiny_qwen3_config
from datasets import Dataset

from longstraw_trl import prompt_state_manager as manager_module
from longstraw_trl.errors import PreflightError, PromptTooLongError
from longstraw_trl.planner import GiB, PlanInputs, plan_memory
from longstraw_trl.preflight import auto_candidates, plan_step

PROMPTS = ["the quick brown fox jumps over the lazy dog. " * 2, "a long straw: 1234567890 " * 3]
# one generation batch, one optimizer step: the first batch's plan and capture, then the loss
ONE_STEP = dict(max_steps=1, gradient_accumulation_steps=1, per_device_train_batch_size=4, num_generations=2)
PREFLIGHT_LOGGER = "longstraw_trl.preflight"


def _dataset(prompts=PROMPTS, n=2):
    return Dataset.from_dict({"prompt": [prompts[i % len(prompts)] for i in range(n)]})


@pytest.fixture
def captures(monkeypatch):
    """The `offload_prompt_state` of every capture the trainer starts, in order."""
    seen = []
    capture = manager_module.capture_prompt

    def recording(model, prompt_ids, **kwargs):
        seen.append(kwargs.get("offload_prompt_state"))
        return capture(model, prompt_ids, **kwargs)

    monkeypatch.setattr(manager_module, "capture_prompt", recording)
    return seen


def _trainer(budget=None, **kwargs):
    kwargs.setdefault("train_dataset", _dataset())
    # the memory settings as given (not "auto"), so that only the state's place is decided; "auto" has its own tests
    kwargs.setdefault("capture_chunk_size", 8192)
    kwargs.setdefault("replay_batch_tokens", 8192)
    return make_tiny_longstraw_trainer(
        preflight_gpu_memory_bytes=budget, page_size=16, seed=0, **{**ONE_STEP, **kwargs}
    )


def _peaks() -> tuple[int, int]:
    """The planned peaks of the tiny model's step, its state on the device and offloaded: one run with a budget
    that fits both."""
    trainer = _trainer(budget=1 << 50)
    trainer.train()
    decision = trainer.preflight.decision
    assert decision.offload_prompt_state is None and decision.resident.fits and decision.offloaded.fits
    assert decision.offloaded.peak < decision.resident.peak  # the offloaded state is off the device
    return decision.resident.peak, decision.offloaded.peak


# ----------------------------------------------------------------------------------------------------------------------
# The pre-flight plan
# ----------------------------------------------------------------------------------------------------------------------
def test_auto_offloads_only_where_the_state_on_the_device_does_not_fit(captures, caplog):
    resident, offloaded = _peaks()
    assert captures and all(offload is None for offload in captures)
    captures.clear()
    # between the two peaks: only the offloaded plan fits, and "auto" takes it, logging what and why
    with caplog.at_level(logging.INFO, logger=PREFLIGHT_LOGGER):
        trainer = _trainer(budget=(resident + offloaded) // 2)
        trainer.train()
    decision = trainer.preflight.decision
    assert decision.offload_prompt_state == "cpu" and decision.fits and not decision.resident.fits
    assert captures and all(offload == "cpu" for offload in captures)
    chosen = [r for r in caplog.records if r.name == PREFLIGHT_LOGGER and "pre-flight plan" in r.getMessage()]
    assert len(chosen) == 1 and chosen[0].levelno == logging.WARNING, [r.getMessage() for r in chosen]
    message = chosen[0].getMessage()
    assert "in host memory (offload_prompt_state='cpu')" in message and "offloaded: peak" in message
    assert "num_generations=2" in message and "max_completion_length=16" in message


def test_without_a_gpu_or_a_budget_auto_keeps_the_state_on_the_device(captures, caplog):
    with caplog.at_level(logging.INFO, logger=PREFLIGHT_LOGGER):
        trainer = _trainer()
        trainer.train()
    assert trainer.preflight.decision is None and captures and all(offload is None for offload in captures)
    assert any(
        "not made (no GPU and no preflight_gpu_memory_bytes)" in r.getMessage() for r in caplog.records
    )


@pytest.mark.parametrize("offload", ["auto", None])
def test_a_step_that_does_not_fit_is_refused_before_any_capture(offload, captures, tmp_path):
    """Neither plan fits ("auto"), or the one asked for does not (an explicit choice is not overridden): refused
    with the planner's table and the changes that fit, before any capture; a checkpoint already there is intact."""
    trainer = _trainer(budget=1 << 50)
    inputs = trainer.preflight.plan_inputs(2, 1 << 50)
    config = tiny_qwen3_config()
    # a generation batch holds both prompts (one group each), so their states are held together
    tokens = sum(len(ids) for ids in trainer.processing_class(text=PROMPTS)["input_ids"])
    offloaded = plan_memory(config, tokens, inputs, offload_prompt_state="cpu").peak
    budget = (
        offloaded - 1 if offload == "auto" else (plan_memory(config, tokens, inputs).peak + offloaded) // 2
    )
    output_dir = tmp_path / "out"
    checkpoint = output_dir / "checkpoint-3"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text('{"global_step": 3}')
    trainer = _trainer(budget=budget, offload_prompt_state=offload, output_dir=str(output_dir))
    with pytest.raises(PreflightError) as refused:
        trainer.train()
    message = str(refused.value)
    assert not captures
    assert "capture peak" in message and "DOES NOT FIT" in message and "Nothing was captured" in message
    decision = trainer.preflight.decision
    assert not decision.fits and decision.suggestions and decision.prompt_tokens == tokens
    assert "Changes that fit" in message and "preflight_plan=False" in message
    for s in decision.suggestions:  # each named in the config's terms, and each fits the budget
        assert s.peak <= budget
        for name, value in s.options.items():
            assert (f"rank {value}" if name == "lora_rank" else f"{name}={value!r}") in message
    if offload == "auto":  # the shorter response is among them
        assert any("max_completion_length" in s.options for s in decision.suggestions)
    else:  # offloading is what the user did not choose: named, not taken
        assert "offload_prompt_state='cpu'" in message
    assert os.listdir(output_dir) == ["checkpoint-3"] and os.listdir(checkpoint) == ["trainer_state.json"]
    assert (checkpoint / "trainer_state.json").read_text() == '{"global_step": 3}'


def test_offloaded_layers_that_fit_what_the_plan_leaves_stay_on_the_device(monkeypatch):
    """Between the two peaks the state goes to host memory, but whole layers stay on the device within 90% of what
    the offloaded plan leaves free: the plan counts them, the captures place them so, the step trains; with
    ``offload_keep_layers_on_device=False`` every layer streams (the same budget)."""
    resident, offloaded = _peaks()
    shares = []
    capture = manager_module.capture_prompt

    def recording(model, prompt_ids, **kwargs):
        state = capture(model, prompt_ids, **kwargs)
        shares.append((kwargs.get("device_share"), [layer.offloaded for layer in state.layers.values()]))
        return state

    monkeypatch.setattr(manager_module, "capture_prompt", recording)
    budget = (
        resident - 1
    )  # the state on the device misses by a byte: the share has room for some of its layers
    trainer = _trainer(budget=budget)
    trainer.train()
    decision = trainer.preflight.decision
    assert decision.offload_prompt_state == "cpu" and decision.fits and trainer.state.global_step == 1
    assert decision.device_state_bytes == int(0.9 * (decision.offloaded.gpu_bytes - decision.offloaded.peak))
    assert 0 < decision.plan.host_state < decision.offloaded.host_state and decision.plan.peak <= budget
    assert "kept on the device within" in decision.placement
    share = shares[0][0]  # one share for the batch's captures, taken in capture and layer order
    assert all(s is share for s, _ in shares) and share.budget == decision.device_state_bytes
    assert 0 < share.taken <= share.budget
    placed = [offloaded for _, layers in shares for offloaded in layers]
    assert (
        False in placed and True in placed and placed == sorted(placed)
    )  # the first layers stay, the rest stream

    shares.clear()
    trainer = _trainer(budget=budget, offload_keep_layers_on_device=False)
    trainer.train()
    decision = trainer.preflight.decision
    assert decision.device_state_bytes == 0 and decision.plan.host_state == decision.offloaded.host_state
    assert shares and all(share is None and all(placed) for share, placed in shares)


def test_auto_memory_settings_are_lowered_before_the_state_is_offloaded(captures, caplog):
    """`replay_batch_tokens="auto"` / `capture_chunk_size="auto"` (the defaults): where the state on the device fits
    only with less replay batching, the plan takes that (the loss replays so) instead of offloading; with the
    settings given as numbers the same budget offloads (the negative control)."""
    trainer = _trainer(budget=1 << 50, replay_batch_tokens="auto", capture_chunk_size="auto")
    trainer.train()
    decision = trainer.preflight.decision
    assert decision.settings == {} and trainer.streamed_loss.options.replay_batch_tokens == 8192
    config = trainer.model.config
    one_at_a_time = PlanInputs.of(decision.inputs, replay_batch_tokens=0)
    budget = plan_memory(config, decision.prompt_tokens, one_at_a_time, offload_prompt_state=None).peak + 4096
    assert budget < decision.resident.peak  # one response at a time holds less than the batch
    captures.clear()
    with caplog.at_level(logging.INFO, logger=PREFLIGHT_LOGGER):
        trainer = _trainer(budget=budget, replay_batch_tokens="auto", capture_chunk_size="auto")
        trainer.train()
    decision = trainer.preflight.decision
    assert decision.offload_prompt_state is None and decision.fits and trainer.state.global_step == 1
    assert (
        decision.settings == {"replay_batch_tokens": 0}
        and trainer.streamed_loss.options.replay_batch_tokens == 0
    )
    assert captures and all(offload is None for offload in captures)
    (line,) = [r.getMessage() for r in caplog.records if "pre-flight plan (" in r.getMessage()]
    assert "with replay_batch_tokens=0 (chosen for 'auto')" in line
    # 8192 as given: the state cannot stay on the device (it goes to the host where that fits, else a refusal)
    trainer = _trainer(budget=budget)
    try:
        trainer.train()
    except PreflightError:
        assert not trainer.preflight.decision.fits
    else:
        assert trainer.preflight.decision.offload_prompt_state == "cpu"
    assert trainer.preflight.decision.settings == {}


def test_auto_candidates_try_fewer_and_smaller_changes_first():
    inputs = PlanInputs(capture_chunk_size=4096, replay_batch_tokens=8192, gradient_mode="full")
    names = ("capture_chunk_size", "replay_batch_tokens", "prompt_backward_checkpoint_layers")
    candidates = auto_candidates(inputs, names)
    assert candidates[:4] == [{}, {"replay_batch_tokens": 4096}, {"prompt_backward_checkpoint_layers": True},
                              {"capture_chunk_size": 2048}]  # fmt: skip
    assert candidates[-1] == {"replay_batch_tokens": 0, "prompt_backward_checkpoint_layers": True,
                              "capture_chunk_size": 1024}  # fmt: skip
    assert len(candidates) == 4 * 2 * 3 and len({tuple(sorted(c.items())) for c in candidates}) == len(
        candidates
    )
    assert auto_candidates(inputs, ()) == [{}]
    response_only = PlanInputs.of(inputs, gradient_mode="response_only")
    assert all("prompt_backward_checkpoint_layers" not in c for c in auto_candidates(response_only, names))


def test_without_the_preflight_plan_the_over_budget_step_goes_ahead(captures):
    """The negative control of the refusal: the same budget, with the plan skipped, captures and trains."""
    trainer = _trainer(budget=1, preflight_plan=False)
    trainer.train()
    assert trainer.preflight.decision is None and captures and all(offload is None for offload in captures)
    assert trainer.state.global_step == 1


def test_the_step_is_planned_again_only_when_it_grows():
    preflight = _trainer(budget=1 << 50).preflight
    assert preflight.before_capture([100, 60], 2) is None and preflight.planned == (160, 2)
    first = preflight.decision
    # within what was planned: not planned again
    assert preflight.before_capture([90, 50], 2) is None and preflight.decision is first
    # more prompt tokens, or more generations: planned again
    preflight.before_capture([200], 2)
    assert preflight.planned == (200, 2) and preflight.decision is not first
    preflight.before_capture([10], 4)
    assert preflight.planned == (200, 4) and preflight.decision.inputs.num_generations == 4


def test_plan_step_is_the_decision_longstraw_plan_prints():
    config = tiny_qwen3_config()
    inputs = PlanInputs(num_generations=2, max_completion_length=16, dtype_bytes=4, gpu_memory_gib=1024)
    fits = plan_step(config, 1000, inputs)
    assert fits.offload_prompt_state is None and fits.fits and not fits.suggestions
    resident, offloaded = fits.resident.peak, fits.offloaded.peak
    between = PlanInputs.of(inputs, gpu_memory_gib=(resident + offloaded) / 2 / GiB)
    assert plan_step(config, 1000, between).offload_prompt_state == "cpu"
    asked = plan_step(
        config, 1000, between, offload_prompt_state=None
    )  # an explicit choice is planned as given
    assert asked.offload_prompt_state is None and not asked.fits and asked.suggestions
    with pytest.raises(ValueError, match="offload_prompt_state must be 'auto', None or 'cpu'"):
        plan_step(config, 1000, inputs, offload_prompt_state="gpu")


# ----------------------------------------------------------------------------------------------------------------------
# Positions, before any capture
# ----------------------------------------------------------------------------------------------------------------------
def test_an_over_long_prompt_is_refused_at_construction_naming_the_row():
    """The tiny model takes 512 positions; the toy tokenizer makes a token of each character."""
    rows = [PROMPTS[0], PROMPTS[1], "x" * 600, PROMPTS[0], "y" * 700]
    with pytest.raises(
        PromptTooLongError,
        match=r"train_dataset: 2 prompt\(s\) too long for the model: row 2 \(60\d tokens\), row 4 \(70\d tokens\)\. "
        r"A prompt plus max_completion_length=16 must fit the model's 512 positions \(max_position_embeddings\), "
        r"which leaves at most 496 prompt tokens\. .*a smaller max_completion_length.*rope_type",
    ):
        _trainer(train_dataset=Dataset.from_dict({"prompt": rows}))
    chats = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "z" * 600}]]}
    )
    with pytest.raises(
        PromptTooLongError, match=r"eval_dataset: 1 prompt\(s\) too long for the model: row 1 \("
    ):
        _trainer(eval_dataset=chats)


def test_prompt_plus_max_completion_length_over_the_limit_is_refused_at_construction():
    row = "z" * 480  # fits alone, not with 40 completion tokens
    _trainer(train_dataset=_dataset([row]), max_completion_length=16)
    with pytest.raises(
        PromptTooLongError, match=r"row 0 \(48\d tokens\), row 1 .*max_completion_length=40 .*at most 472"
    ):
        _trainer(train_dataset=_dataset([row]), max_completion_length=40)


def test_a_streamed_over_long_prompt_is_refused_before_its_capture(captures):
    from datasets import IterableDataset

    def rows():
        yield from ({"prompt": p} for p in [PROMPTS[0]] * 2 + ["w" * 600] * 2)

    trainer = _trainer(train_dataset=IterableDataset.from_generator(rows), per_device_train_batch_size=4)
    with pytest.raises(
        PromptTooLongError,
        match=r"this generation batch \(global step 0\): 2 prompt\(s\) too long .*row \d \(600 tokens\)",
    ):
        trainer.train()
    assert not captures


# ----------------------------------------------------------------------------------------------------------------------
# The objective, stated at construction
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["response_only", "full"])
def test_the_objective_is_stated_at_construction(mode, caplog):
    with caplog.at_level(logging.INFO, logger="longstraw_trl.trainer"):
        _trainer(gradient_mode=mode)
    lines = [r for r in caplog.records if "LongStrawGRPOTrainer objective" in r.getMessage()]
    assert len(lines) == 1
    message = lines[0].getMessage()
    if mode == "full":
        assert "TRL's full-sequence GRPO gradient" in message and lines[0].levelno == logging.INFO
    else:
        assert lines[0].levelno == logging.WARNING
        assert (
            "held constant" in message
            and "differ from TRL's" in message
            and "gradient_mode='full'" in message
        )


def test_longstraw_plan_with_offload_auto_prints_the_trainers_decision(capsys):
    """`longstraw plan --offload auto` is the pre-flight decision: the whole Qwen3.6-27B at 262K on an 80 GB card
    does not fit with its state on the device, and does offloaded."""
    from longstraw_trl.cli import main

    argv = [
        "plan",
        "qwen3.6-27b",
        "--prompt",
        "262144",
        "--response",
        "1024",
        "--lora-rank",
        "64",
        "--gpu",
        "h100",
    ]
    assert main([*argv, "--offload", "auto", "--json"]) == 0
    auto = json.loads(capsys.readouterr().out)
    assert auto["offload_chosen"] == "cpu" and auto["fits"] and auto["host_state"] > 0
    assert main([*argv, "--json"]) == 1  # the state on the device, as offload_prompt_state=None asks
    resident = json.loads(capsys.readouterr().out)
    assert not resident["fits"] and ["--offload", "cpu"] in [s["args"] for s in resident["suggestions"]]
    assert main([*argv, "--offload", "auto"]) == 0
    assert "offload_prompt_state='auto': the prompt state in host memory" in capsys.readouterr().out


def test_an_agent_turn_too_long_for_the_model_is_refused_before_its_extension_is_captured():
    """A tool turn's rollout (prompt, completion so far, tool output) plus max_completion_length beyond the model's
    positions: refused naming the row, before its state is looked up or extended."""
    from types import SimpleNamespace

    from longstraw_trl.generation import SamplingParams
    from longstraw_trl.positions import PositionLimit
    from longstraw_trl.rollout import Rollout

    class NoStates:  # the check comes first: nothing of the prompt states is touched
        tool_turn_keys = set()

        def acquire(self, *args, **kwargs):
            raise AssertionError("captured before the check")

    host = SimpleNamespace(global_step=3)
    limit = PositionLimit(512, "max_position_embeddings", 512)
    rollout = Rollout(host, NoStates(), SamplingParams(max_new_tokens=16), [2], position_limit=limit)
    with pytest.raises(
        PromptTooLongError,
        match=r"a tool turn's rollouts \(global step 3\): 1 prompt\(s\) too long for the model: row 1 \(500 tokens\)",
    ):
        rollout.tool_turn([[5] * 400, [5] * 500])
