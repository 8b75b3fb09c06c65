"""The planner's inputs (`PlanInputs`): one object for `plan_memory`, `largest_prompt` and `suggest_changes`, its fields
named as the config names them, the short keyword names still taken, and built from a config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from longstraw_trl.constants import GradientMode
from longstraw_trl.errors import LongStrawError
from longstraw_trl.planner import PlanInputs, largest_prompt, plan_memory, suggest_changes
from longstraw_trl.presets import preset_config


def test_short_names_set_the_config_named_fields():
    short = PlanInputs.of(response_tokens=64, checkpoint_layers=True, offload="cpu", prefix_sharing=True)
    named = PlanInputs(
        max_completion_length=64,
        replay_checkpoint_layers=True,
        offload_prompt_state="cpu",
        prompt_prefix_sharing=True,
    )
    assert short == named
    assert PlanInputs.of(named, cp_size=2) == PlanInputs(**{**named.__dict__, "cp_size": 2})


def test_an_input_given_twice_or_unknown_is_refused():
    with pytest.raises(TypeError, match="offload_prompt_state"):
        PlanInputs.of(offload="cpu", offload_prompt_state="cpu")
    with pytest.raises(TypeError):
        PlanInputs.of(response=64)


def test_refusals_name_the_option():
    with pytest.raises(LongStrawError, match="gradient_mode"):
        PlanInputs(gradient_mode="exact")
    with pytest.raises(LongStrawError, match="offload"):
        PlanInputs(offload_prompt_state="nvme")
    with pytest.raises(LongStrawError, match="fsdp_size"):
        PlanInputs(fsdp_size=-1)
    assert PlanInputs(gradient_mode="full").gradient_mode is GradientMode.FULL
    with pytest.raises(LongStrawError, match="prompt_prefix_sharing must be one of 'off', 'batch', 'all'"):
        PlanInputs(prompt_prefix_sharing="sometimes")


def test_the_inputs_object_plans_as_the_keywords_do():
    config = preset_config("qwen3.6-27b", 8)
    keywords = dict(
        lora_rank=64,
        gradient_mode="full",
        offload_prompt_state="cpu",
        checkpoint_layers=True,
        gpu_memory_gib=20,
    )
    inputs = PlanInputs.of(**keywords)
    assert plan_memory(config, 1 << 18, inputs) == plan_memory(config, 1 << 18, **keywords)
    assert largest_prompt(config, inputs) == largest_prompt(config, **keywords)
    assert suggest_changes(config, 1 << 22, inputs) == suggest_changes(config, 1 << 22, **keywords)


def test_from_config_reads_the_configs_names():
    args = SimpleNamespace(
        num_generations=4,
        max_completion_length=512,
        page_size=4096,
        cp_size=2,
        ep_size=1,
        capture_chunk_size=2048,
        gradient_checkpointing=False,
        replay_checkpoint_layers=True,
        prompt_backward_checkpoint_layers=False,
        replay_batch_tokens=1024,
        gradient_mode="full",
        prompt_prefix_sharing=False,
        offload_prompt_state="cpu",
    )
    inputs = PlanInputs.from_config(args, lora_rank=16)
    assert inputs == PlanInputs(
        num_generations=4,
        max_completion_length=512,
        page_size=4096,
        cp_size=2,
        capture_chunk_size=2048,
        replay_checkpoint_layers=True,
        prompt_backward_checkpoint_layers=False,
        replay_batch_tokens=1024,
        gradient_mode="full",
        prompt_prefix_sharing="off",
        offload_prompt_state="cpu",
        lora_rank=16,
    )
