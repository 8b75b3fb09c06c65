"""`longstraw plan` on bad input (one line on stderr, exit 2) and its suggestions for a plan that does not fit."""

from __future__ import annotations

import json

import pytest
from transformers import GPT2Config

from longstraw_trl.cli import main

SMALL = ["--prompt", "65536", "--layers", "2"]


def _error(capsys, argv: list[str]) -> str:
    """Run the CLI in-process on bad input; the one stderr line it printed."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert out == "" and err.startswith("longstraw plan: error: ") and err.count("\n") == 1, err
    return err


def test_unsupported_model_type_names_the_supported_ones(tmp_path, capsys):
    GPT2Config().save_pretrained(tmp_path)
    err = _error(capsys, ["plan", str(tmp_path), *SMALL])
    assert "'gpt2' is not supported" in err and str(tmp_path) in err
    assert "supported model types: " in err and "qwen3" in err and "qwen3_5" in err


def test_model_type_transformers_does_not_know(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not_a_model"}))
    err = _error(capsys, ["plan", str(tmp_path), *SMALL])
    assert "'not_a_model' is not supported" in err and "supported model types: " in err


def test_directory_without_config(tmp_path, capsys):
    err = _error(capsys, ["plan", str(tmp_path), *SMALL])
    assert "no config.json" in err and "qwen3-8b" in err


def test_missing_directory(tmp_path, capsys):
    err = _error(capsys, ["plan", str(tmp_path / "no-such-model"), *SMALL])
    assert f"no such directory: {tmp_path / 'no-such-model'}" in err and "preset: qwen3-8b" in err


def test_mistyped_preset_gets_the_closest_names(capsys):
    err = _error(capsys, ["plan", "qwen3-8", *SMALL])
    assert "unknown preset 'qwen3-8'" in err and "did you mean qwen3-8b" in err
    assert "presets: qwen3-8b, qwen3.6-27b, glm-5" in err


@pytest.mark.parametrize("gpu", ["a100", "0", "nan"])
def test_bad_gpu_lists_the_known_ones_and_numbers(capsys, gpu):
    err = _error(capsys, ["plan", "qwen3-8b", *SMALL, "--gpu", gpu])
    assert f"--gpu {gpu!r}" in err and "h200 (139.8 GiB)" in err and "GiB, e.g. --gpu 80" in err
    if gpu == "a100":
        assert "did you mean" in err and "a100-80g" in err and "a100-40g" in err


def test_non_positive_sizes(capsys):
    err = _error(capsys, ["plan", "qwen3-8b", *SMALL, "--cp", "0"])
    assert "--cp must be >= 1, got 0" in err


def _plan_json(capsys, argv: list[str]) -> tuple[int, dict]:
    status = main(["plan", *argv, "--json"])
    return status, json.loads(capsys.readouterr().out)


def test_suggestions_each_fit_when_replanned(capsys):
    """Full fine-tuning of the 27B at 2M tokens needs ~410 GiB: every suggestion, appended to the command
    line (the last --prompt / --cp wins), must make `longstraw plan` say it fits, at the peak it promised."""
    argv = ["qwen3.6-27b", "--prompt", "2097152", "--gpu", "h200", "--no-checkpoint-layers"]
    status, plan = _plan_json(capsys, argv)
    assert status == 1 and not plan["fits"]
    suggestions = plan["suggestions"]
    flags = {a for s in suggestions for a in s["args"] if a.startswith("--")}
    assert {"--cp", "--lora-rank", "--prompt", "--checkpoint-layers"} <= flags, suggestions
    for s in suggestions:
        status, replanned = _plan_json(capsys, argv + s["args"])
        assert status == 0 and replanned["fits"], s
        assert replanned["prompt_tokens"] == s["prompt_tokens"]
        assert max(replanned["capture_peak"], replanned["replay_peak"]) == s["peak"]
        assert replanned["suggestions"] == []
    # the text output names the same changes
    assert main(["plan", *argv]) == 1
    text = capsys.readouterr().out
    assert "DOES NOT FIT" in text and "to fit 139.80 GiB" in text
    for s in suggestions:
        assert " ".join(s["args"]) in text


def test_suggested_cp_and_prompt_are_the_edges(capsys):
    """The suggested --cp is the smallest power of two that fits, the suggested --prompt the largest P."""
    argv = ["qwen3.6-27b", "--prompt", "2097152", "--lora-rank", "64", "--checkpoint-layers"]
    _, plan = _plan_json(capsys, argv)
    by_flag = {s["args"][0]: s for s in plan["suggestions"]}
    assert set(by_flag) == {"--cp", "--prompt", "--offload"}, plan["suggestions"]
    offload = by_flag["--offload"]  # the K/V pages to the host (the GDN states stay): it names their bytes
    assert offload["host_bytes"] == plan["state_by_kind"]["kv"] and offload["peak"] <= plan["gpu_bytes"]
    cp = int(by_flag["--cp"]["args"][1])
    assert _plan_json(capsys, argv + ["--cp", str(cp)])[1]["fits"]
    assert not _plan_json(capsys, argv + ["--cp", str(cp // 2)])[1]["fits"]
    p = by_flag["--prompt"]["prompt_tokens"]
    assert not _plan_json(capsys, argv + ["--prompt", str(p + 16384)])[1]["fits"]
