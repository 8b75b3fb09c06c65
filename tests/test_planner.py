"""`longstraw plan` against peaks measured on the H200 (bench/results/engine_*.json)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from longstraw_trl.planner import GiB, largest_prompt, plan_memory, state_bytes
from longstraw_trl.presets import preset_config

RESULTS = sorted((Path(__file__).parent.parent / "bench" / "results").glob("engine_*.json"))
COMPARE_RESULTS = sorted((Path(__file__).parent.parent / "bench" / "results").glob("compare_stock_*.json"))
CP_RESULTS = sorted((Path(__file__).parent.parent / "bench" / "results").glob("cp[0-9]*_*.json"))


def _arg(command: str, flag: str, default=None):
    words = shlex.split(command)
    return words[words.index(flag) + 1] if flag in words else default


@pytest.mark.parametrize("path", RESULTS, ids=[p.stem for p in RESULTS])
def test_plan_reproduces_measured_peaks(path):
    data = json.loads(path.read_text())
    preset = data.get("preset") or _arg(data["command"], "--preset", "qwen3-8b")
    config = preset_config(preset, data["layers"])
    for i, result in enumerate(data["results"]):
        p = result["prompt_tokens"]
        plan = plan_memory(
            config,
            p,
            response_tokens=data["response_tokens"],
            optimizer="none",  # the benchmark runs backward without an optimizer
            capture_chunk_size=data["chunk_size"],
            page_size=data["page_size"],
        )
        # the state is a formula: exact
        assert plan.state_by_kind == result["state_bytes_by_kind"]
        measured_capture = result["capture_peak_gib"]
        # the first benchmark runs kept the previous prompt's parameter gradients while capturing the next one
        kept = data.get("gradients_kept_during_capture", True)
        expected_capture = plan.capture_peak + (plan.gradients if i and kept else 0)
        assert abs(expected_capture / GiB - measured_capture) <= 0.10 * measured_capture, (
            expected_capture / GiB,
            measured_capture,
        )
        for rep in result["replays"]:
            measured = rep["replay_peak_gib"]
            assert abs(plan.replay_peak / GiB - measured) <= 0.10 * measured, (
                plan.replay_peak / GiB,
                measured,
            )


def test_state_formula_and_cp_split():
    config = preset_config("qwen3.6-27b")
    one = state_bytes(config, 2_097_152)
    assert one["kv"] == 2 * 16 * 4 * 256 * 2 * 2_097_152  # 128 GiB, DESIGN.md
    eight = state_bytes(config, 2_097_152, cp_size=8)
    assert eight["kv"] == one["kv"] // 8 and eight["gdn"] == one["gdn"]


def test_cli_plan_runs_and_says_whether_it_fits():
    out = subprocess.run(
        [sys.executable, "-m", "longstraw_trl", "plan", "qwen3-8b", "--layers", "2", "--prompt", "65536"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "state[kv]" in out.stdout and "FITS" in out.stdout
    big = subprocess.run(
        [sys.executable, "-m", "longstraw_trl", "plan", "qwen3-8b", "--prompt", "4194304", "--gpu", "80"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert big.returncode == 1 and "DOES NOT FIT" in big.stdout


@pytest.mark.parametrize("path", CP_RESULTS, ids=[p.stem for p in CP_RESULTS])
def test_plan_reproduces_measured_cp_peaks(path):
    data = json.loads(path.read_text())
    config = preset_config(data["preset"], data["layers"])
    plan = plan_memory(
        config,
        data["prompt_tokens"],
        response_tokens=data["response_tokens"],
        cp_size=data["cp_size"],
        optimizer="none",
        capture_chunk_size=data["chunk_size"],
        page_size=data["page_size"],
    )
    for rank in data["ranks"]:
        assert plan.state_by_kind == rank["state_bytes_by_kind"]
        # the small exactness check before the capture leaves no gradients (zero_grad(set_to_none=True))
        assert abs(plan.capture_peak / GiB - rank["capture_peak_gib"]) <= 0.10 * rank["capture_peak_gib"]
        assert abs(plan.replay_peak / GiB - rank["replay_peak_gib"]) <= 0.10 * rank["replay_peak_gib"]


def test_largest_prompt_is_the_fitting_edge():
    config = preset_config("qwen3-8b", 4)
    kwargs = dict(optimizer="none", gpu_memory_gib=80.0)
    p = largest_prompt(config, page_size=16384, **kwargs)
    assert p > 0 and p % 16384 == 0
    assert plan_memory(config, p, page_size=16384, **kwargs).fits
    assert not plan_memory(config, p + 16384, page_size=16384, **kwargs).fits
    # full fine-tuning of the whole 27B model with AdamW does not fit one H200 at any P
    assert largest_prompt(preset_config("qwen3.6-27b")) == 0


def test_cli_max_prompt():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "longstraw_trl",
            "plan",
            "qwen3-8b",
            "--layers",
            "4",
            "--max-prompt",
            "--gpu",
            "80",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "largest prompt that fits" in out.stdout and "FITS" in out.stdout


@pytest.mark.parametrize("path", COMPARE_RESULTS, ids=[p.stem for p in COMPARE_RESULTS])
def test_plan_reproduces_trainer_peaks(path):
    """LongStrawGRPOTrainer's peaks beside stock TRL: TRL's default activation checkpointing is on there."""
    data = json.loads(path.read_text())
    assert data["activation_checkpointing"]
    config = preset_config(data["preset"], data["layers"])
    measured = [r for r in data["results"] if r["longstraw"].get("ok")]
    assert measured
    for r in measured:
        plan = plan_memory(
            config,
            r["prompt_tokens"],
            response_tokens=data["response_tokens"],
            optimizer="none",
            checkpoint_layers=True,
        )
        peak = r["longstraw"]["peak_gib"]
        assert abs(plan.peak / GiB - peak) <= 0.10 * peak, (r["prompt_tokens"], plan.peak / GiB, peak)
