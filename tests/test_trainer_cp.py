"""One LongStrawGRPOTrainer step with cp_size=2 over 2 CPU processes equals the single-process step.

Launched with ``accelerate launch --config_file examples/accelerate/cp2.yaml`` (the shipped config, with
``--mixed_precision no`` so both runs compute in fp32). On a CPU-only machine its MULTI_GPU launcher starts
the processes through torchrun, and the script's ``use_cpu=True`` turns them into a gloo MULTI_CPU group.
A second test keeps TRL's default ``bf16=True`` (CPU bf16 autocast: bf16 page partials) with a prompt
shorter than one page, so the second rank holds no pages at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _spawn import launch_step

from longstraw_trl import LongStrawError

STEP = Path(__file__).parent / "_cp_step.py"
CP2_CONFIG = Path(__file__).parent.parent / "examples" / "accelerate" / "cp2.yaml"


def test_cp2_trainer_step_equals_single_process(tmp_path):
    single = _launch(tmp_path / "single.json", cp_size=1)
    cp = _launch(tmp_path / "cp.json", cp_size=2)
    other = json.loads((tmp_path / "cp.json.rank1").read_text())
    assert len(single["loss"]) == len(cp["loss"]) == 1
    assert abs(single["loss"][0] - cp["loss"][0]) <= 1e-5
    assert set(single["grads"]) == set(cp["grads"]) == set(other["grads"]) and single["grads"]
    worst = 0.0
    for name, ref in single["grads"].items():
        ref_t, got = torch.tensor(ref), torch.tensor(cp["grads"][name])
        assert torch.equal(got, torch.tensor(other["grads"][name])), f"{name}: rank gradients differ"
        worst = max(worst, float((got - ref_t).norm() / ref_t.norm().clamp_min(1e-12)))
    assert any(torch.tensor(g).abs().max() > 0 for g in single["grads"].values())
    print(
        f"cp2 vs single: loss {cp['loss'][0]:.6f} vs {single['loss'][0]:.6f}, worst grad rel L2 {worst:.2e}"
    )
    assert worst <= 1e-5


def test_cp2_bf16_step_with_a_rank_without_pages(tmp_path):
    """Under bf16 autocast the ranks with pages send bf16 partials; a rank without pages must still send
    the same dtype and shape (it used to send fp32 placeholders: gloo aborted with "op.preamble.length <=
    op.nbytes"), and its empty partial must weigh nothing."""
    prompt = "short prompt"  # 12 tokens < page_size 32: every page lives on rank 0
    single = _launch(tmp_path / "single.json", cp_size=1, bf16=True, prompt=prompt)
    cp = _launch(tmp_path / "cp.json", cp_size=2, bf16=True, prompt=prompt)
    other = json.loads((tmp_path / "cp.json.rank1").read_text())
    assert set(single["grads"]) == set(cp["grads"]) == set(other["grads"]) and single["grads"]
    for name, got in cp["grads"].items():
        assert got == other["grads"][name], f"{name}: rank gradients differ"
    assert abs(single["loss"][0] - cp["loss"][0]) <= 1e-3
    # CP merges the prompt part in fp32, the single process in bf16: they differ by bf16 rounding (about
    # as much as the single-process bf16 step differs from the fp32 one, 1.5e-2 here)
    worst = max(
        float(
            (torch.tensor(cp["grads"][n]) - torch.tensor(r)).norm() / torch.tensor(r).norm().clamp_min(1e-12)
        )
        for n, r in single["grads"].items()
    )
    print(f"cp2 bf16 vs single bf16: worst grad rel L2 {worst:.2e}")
    assert worst <= 5e-2


@pytest.mark.parametrize("block", [3, pytest.param(None, marks=pytest.mark.slow)])
def test_cp2_full_gradient_equals_single_process(tmp_path, block):
    """gradient_mode='full', with reverse block replay (``block``) or whole replays (the responses of a group together;
    slow: the same prompt backward): each rank's replays accumulate dK/dV of its own pages, every chunk's dK/dV are
    all-reduced before its (replicated) recompute. Same gradients as one process (which tests/test_full_gradient.py
    checks against stock GRPOTrainer), bit-identical on both ranks."""
    extra = ["--gradient-mode", "full"] + ([] if block is None else ["--replay-block-size", str(block)])
    single = _launch(tmp_path / "single.json", cp_size=1, extra=extra)
    cp = _launch(tmp_path / "cp.json", cp_size=2, extra=extra)
    other = json.loads((tmp_path / "cp.json.rank1").read_text())
    assert abs(single["loss"][0] - cp["loss"][0]) <= 1e-5
    assert set(single["grads"]) == set(cp["grads"]) == set(other["grads"]) and single["grads"]
    worst = 0.0
    for name, ref in single["grads"].items():
        ref_t, got = torch.tensor(ref), torch.tensor(cp["grads"][name])
        assert torch.equal(got, torch.tensor(other["grads"][name])), f"{name}: rank gradients differ"
        worst = max(worst, float((got - ref_t).norm() / ref_t.norm().clamp_min(1e-12)))
    print(f"cp2 full vs single full: worst grad rel L2 {worst:.2e}")
    assert worst <= 1e-5


def _launch(out: Path, cp_size: int, bf16: bool = False, prompt: str | None = None, extra=()) -> dict:
    args = [
        "--cp-size",
        str(cp_size),
        *(["--bf16"] if bf16 else []),
        *(["--prompt", prompt] if prompt else []),
    ]
    args += list(extra)
    if cp_size == 1:  # the single-process reference: the step script itself
        proc = subprocess.run(
            [sys.executable, str(STEP), "--out", str(out), *args],
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            timeout=300,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(out.read_text())
    assert cp_size == 2, "only the shipped cp2.yaml is launched here"
    return launch_step(CP2_CONFIG, out, *args, mixed_precision="bf16" if bf16 else "no")


def test_cp_size_without_a_distributed_launch_is_refused():
    from _trl_helpers import make_tiny_longstraw_trainer

    with pytest.raises(LongStrawError, match="cp_size=2 needs a distributed launch"):
        make_tiny_longstraw_trainer(cp_size=2)
