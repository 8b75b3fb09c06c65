"""`examples/grpo_needle.py` (GRPO on a random-init model) at tiny sizes: its advertised options run end to end."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from _examples import EXAMPLES, load_example
from _spawn import accelerate_launch

EXAMPLE = EXAMPLES / "grpo_needle.py"
TINY = ["--prompt-tokens", "48", "--train-prompts", "4", "--eval-prompts", "1", "--num-generations", "2",
        "--prompts-per-step", "1", "--completion-tokens", "2", "--layers", "4", "--hidden-size", "32"]  # fmt: skip


def _example():
    return load_example("grpo_needle")


def test_beta_trains_against_the_initial_weights(tmp_path, monkeypatch):
    """`--beta 0.04`: TRL builds the reference model from the policy's `name_or_path`, which a random-init model
    leaves empty (OSError: Repo id must use alphanumeric chars ... ''). The example saves the initial weights and
    loads the policy from them: the reference is the policy at step 0, and the KL is logged (0 at the first step,
    positive once the policy has moved)."""
    example = _example()
    built = {}
    trainer_cls = example.LongStrawGRPOTrainer

    class Recording(trainer_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built["trainer"] = self

    monkeypatch.setattr(example, "LongStrawGRPOTrainer", Recording)
    out = tmp_path / "needle"
    example.main([*TINY, "--beta", "0.04", "--steps", "2", "--output-dir", str(out)])
    trainer = built["trainer"]
    assert trainer.beta == 0.04 and trainer.ref_model is not None
    initial = example.AutoModelForCausalLM.from_pretrained(out / "initial_model").state_dict()
    for name, p in trainer.ref_model.state_dict().items():  # the reference is the initial policy, untrained
        assert torch.equal(p.cpu(), initial[name]), name
    kls = [h["kl"] for h in json.loads((out / "log_history.json").read_text()) if "kl" in h]
    assert len(kls) == 2 and kls[0] == 0.0 and math.isfinite(kls[1]) and kls[1] > 0.0, kls


def test_report_to_tensorboard_writes_events(tmp_path):
    """`--report-to tensorboard` (advertised) needs the `tensorboard` package: the `[tensorboard]` extra, pinned in
    requirements-cpu.txt. With it, a run writes an event file under OUTPUT_DIR/runs."""
    pytest.importorskip("tensorboard")
    out = tmp_path / "needle"
    _example().main([*TINY, "--steps", "1", "--report-to", "tensorboard", "--output-dir", str(out)])
    assert list((out / "runs").glob("*/events.out.tfevents.*"))


def test_config_sets_no_deprecated_checkpointing_name(tmp_path, recwarn):
    """The example's config uses transformers' `activation_checkpointing`: no `gradient_checkpointing` FutureWarning
    from building it (TRL's own default would raise one, see tests/test_config_warnings.py)."""
    example = _example()
    seen = {}
    monkey = pytest.MonkeyPatch()
    config_cls = example.LongStrawGRPOConfig

    def recording(*args, **kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            config = config_cls(*args, **kwargs)
        seen["warnings"] = [str(w.message) for w in caught]
        seen["config"] = config
        return config

    monkey.setattr(example, "LongStrawGRPOConfig", recording)
    try:
        example.main([*TINY, "--steps", "1", "--output-dir", str(tmp_path / "needle")])
    finally:
        monkey.undo()
    assert seen["config"].gradient_checkpointing and seen["config"].activation_checkpointing
    assert not [w for w in seen["warnings"] if "gradient_checkpointing" in w], seen["warnings"]


def test_report_to_tensorboard_without_it_says_what_to_install(monkeypatch):
    """Without the package, the example stops before building anything and names the extra (transformers' own error
    says to install tensorboardX, which the project does not use)."""
    example = _example()
    real = example.importlib.util.find_spec
    monkeypatch.setattr(
        example.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    with pytest.raises(SystemExit, match=r"pip install longstraw-trl\[tensorboard\]"):
        example.main([*TINY, "--report-to", "tensorboard"])


def test_two_processes_print_once(tmp_path):
    """Under `accelerate launch` with 2 processes (the shipped cp2.yaml; on a CPU-only machine its launcher starts
    both and the example joins them in a gloo group) the "model:" line, the step bar and the summary appear once, and
    so do transformers' weight-loading bars of the policy and the reference (`--beta`: the first process saves the
    initial weights, the other waits for them)."""
    config = EXAMPLE.parent / "accelerate" / "cp2.yaml"
    proc = accelerate_launch(
        config,
        [
            EXAMPLE,
            *TINY,
            "--cp-size",
            "2",
            "--steps",
            "1",
            "--beta",
            "0.04",
            "--output-dir",
            tmp_path / "needle",
        ],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert sum(x.startswith("model: random-init") for x in lines) == 1, proc.stdout
    assert sum(x == "summary" for x in lines) == 1, proc.stdout
    assert proc.stderr.count("GRPO:   0%") == 1, proc.stderr[-3000:]
    assert proc.stderr.count("Loading weights:   0%") == 2, proc.stderr[
        -3000:
    ]  # the policy and the reference
