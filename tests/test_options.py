"""Each concern's options, resolved once from the config under the config's names (`longstraw_trl.options`); the
gradient mode as one enum; the kernel switches behind one variable (`LONGSTRAW_DISABLE`)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from longstraw_trl.config import LongStrawGRPOConfig
from longstraw_trl.constants import GradientMode
from longstraw_trl.kernels.attention import prompt_response
from longstraw_trl.kernels.runtime.switches import DISABLE_ENV, SWITCHES, disabled, enabled
from longstraw_trl.options import CaptureOptions, LossOptions, plan_options


def _config(tmp_path, **overrides) -> LongStrawGRPOConfig:
    kwargs = dict(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=4, num_generations=4
    )
    return LongStrawGRPOConfig(**{**kwargs, **overrides})


def test_gradient_mode_parses_what_users_write():
    assert GradientMode.parse("full") is GradientMode.FULL and GradientMode.FULL.full
    assert GradientMode.parse("response_only") is GradientMode.RESPONSE is GradientMode.parse(" Response ")
    assert not GradientMode.RESPONSE.full and str(GradientMode.RESPONSE) == "response_only"
    with pytest.raises(ValueError, match="gradient_mode must be one of 'response_only', 'full'"):
        GradientMode.parse("prompt")


def test_capture_options_from_config_use_the_config_names(tmp_path):
    config = _config(
        tmp_path,
        capture_chunk_size=64,
        page_size=32,
        offload_prompt_state="cpu",
        prompt_prefix_sharing=True,
        gradient_mode="full",
    )
    group = object()
    capture = CaptureOptions.from_config(config, cp_group=group)
    for field in dataclasses.fields(CaptureOptions):
        if field.name != "cp_group":  # the trainer's, not the config's
            assert getattr(capture, field.name) == getattr(config, field.name), field.name
    assert capture.cp_group is group and capture.keep_boundaries
    # the boundaries: kept for the full gradient, or for prefix sharing across batches ("all", True), not otherwise
    assert CaptureOptions(gradient_mode="full").keep_boundaries
    assert CaptureOptions(prompt_prefix_sharing=True).keep_boundaries
    assert CaptureOptions(prompt_prefix_sharing="all").keep_boundaries
    assert not CaptureOptions().keep_boundaries and CaptureOptions().batch_trunks
    assert not CaptureOptions(prompt_prefix_sharing=False).batch_trunks
    # one default across layers: the config's
    defaults = _config(tmp_path)
    assert CaptureOptions().prompt_prefix_sharing == defaults.prompt_prefix_sharing
    assert CaptureOptions().gradient_mode is defaults.gradient_mode is GradientMode.RESPONSE


def test_loss_options_from_config(tmp_path):
    config = _config(
        tmp_path,
        gradient_mode="full",
        replay_block_size=16,
        replay_batch_tokens=0,
        replay_checkpoint_layers=True,
        prompt_backward_checkpoint_layers=False,
        autograd_fused_kernels=False,
        capture_chunk_size=128,
        temperature=0.7,
    )
    loss = LossOptions.from_config(config)
    for field in dataclasses.fields(LossOptions):
        if field.name != "gradient_checkpointing":
            assert getattr(loss, field.name) == getattr(config, field.name), field.name
    assert loss.gradient_mode is GradientMode.FULL
    assert loss.gradient_checkpointing is bool(config.gradient_checkpointing)
    assert LossOptions.from_config(config, temperature=1.3).temperature == 1.3
    assert loss.segment_checkpoint_layers is True and loss.prompt_segment_checkpoint_layers is False
    # strings are accepted where the options are built by hand, and resolved to the enum
    assert LossOptions(gradient_mode="full").gradient_mode is GradientMode.FULL


def test_plan_options_follow_the_config(tmp_path):
    config = _config(tmp_path, gradient_mode="full", offload_prompt_state="cpu", prompt_prefix_sharing=True)
    plan = plan_options(config)
    assert (
        plan["gradient_mode"] == "full"
        and plan["offload_prompt_state"] == "cpu"
        and plan["prompt_prefix_sharing"] == "all"
    )
    # "auto" (the default) plans the preferred chunk; a number as given
    assert (
        config.capture_chunk_size == "auto"
        and plan["capture_chunk_size"] == 8192
        and plan["num_generations"] == 4
    )
    assert plan_options(_config(tmp_path, capture_chunk_size=2048))["capture_chunk_size"] == 2048
    # the replay's layers are recomputed under either checkpointing option
    namespace = SimpleNamespace(
        **{**vars(config), "gradient_checkpointing": False, "replay_checkpoint_layers": True}
    )
    assert plan_options(namespace)["checkpoint_layers"] is True


@pytest.mark.parametrize(
    ("value", "off"),
    [
        (None, set()),
        ("", set()),
        ("prompt_dq", {"prompt_dq"}),
        (" GDN_decode , prompt_dq,,", {"gdn_decode", "prompt_dq"}),
    ],
)
def test_disable_lists_switches(monkeypatch, value, off):
    if value is None:
        monkeypatch.delenv(DISABLE_ENV, raising=False)
    else:
        monkeypatch.setenv(DISABLE_ENV, value)
    assert disabled() == off
    for name in SWITCHES:
        assert enabled(name) is (name not in off), name
    # a fast path reads it through the switch
    assert prompt_response._use_prompt_dq() is ("prompt_dq" not in off)


def test_disable_refuses_an_unknown_name(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "gdn_decode,flash_decode")
    with pytest.raises(
        ValueError, match="unknown kernel switch\\(es\\) flash_decode; valid names: autotune_pins, "
    ):
        enabled("gdn_decode")
    with pytest.raises(KeyError, match="unknown kernel switch 'gdn'"):
        monkeypatch.delenv(DISABLE_ENV)
        enabled("gdn")
