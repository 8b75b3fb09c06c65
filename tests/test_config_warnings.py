"""Building a `LongStrawGRPOConfig` should not warn about names transformers deprecated."""

from __future__ import annotations

import warnings

from longstraw_trl import LongStrawGRPOConfig


def _checkpointing_warnings(**kwargs) -> tuple[LongStrawGRPOConfig, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = LongStrawGRPOConfig(output_dir="unused", use_cpu=True, report_to="none", **kwargs)
    return config, [str(w.message) for w in caught if "checkpointing" in str(w.message)]


def test_activation_checkpointing_is_the_quiet_form():
    """transformers 5.23 deprecates `gradient_checkpointing`; TrainingArguments mirrors the new name into the old one,
    so a config that sets `activation_checkpointing` gets no FutureWarning and the trainer (which reads
    `args.gradient_checkpointing`) sees the same value."""
    for value in (True, False):
        config, caught = _checkpointing_warnings(activation_checkpointing=value)
        assert (
            not caught and config.gradient_checkpointing is value and config.activation_checkpointing is value
        )


def test_default_config_does_not_warn():
    config, caught = _checkpointing_warnings()
    assert not caught, caught
    assert (
        config.gradient_checkpointing is True and config.activation_checkpointing is True
    )  # TRL's default kept
