"""`longstraw`: its help (at once, before torch loads), `longstraw plan` from the repository root, on bad input (one
line on stderr, exit 2) and its suggestions for a plan that does not fit."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import GPT2Config

from longstraw_trl.cli import COMMANDS, main

GiB = 2**30
SMALL = ["--prompt", "65536", "--layers", "2"]
ROOT = Path(__file__).resolve().parents[1]


def _longstraw(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m longstraw_trl ARGV`` from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "longstraw_trl", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_lists_the_commands_at_once():
    start = time.perf_counter()
    proc = _longstraw("--help")
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "usage: longstraw <command> [options]"
    for name, command in COMMANDS.items():  # one line each, with its summary
        assert sum(line.split()[:1] == [name] for line in lines) == 1, proc.stdout
        assert f"  {name}  {command.summary}" in lines, proc.stdout
    assert seconds < 5, f"longstraw --help took {seconds:.1f} s"  # torch alone takes seconds to import


def test_help_imports_no_heavy_module():
    probe = (
        "import runpy, sys\n"
        "sys.argv = ['longstraw', '--help']\n"
        "try:\n"
        "    runpy.run_module('longstraw_trl', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "print(sorted(m for m in ('torch', 'transformers', 'trl', 'triton') if m in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "[]", proc.stdout[-2000:]


def test_plan_runs_from_the_repository_root():
    proc = _longstraw("plan", "qwen3-8b", "--prompt", "131072")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "->  FITS" in proc.stdout and "state[kv]" in proc.stdout, proc.stdout


def test_unknown_command_names_the_commands(capsys):
    assert main(["pln"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "unknown command 'pln'; did you mean plan? commands: plan" in err


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
    err = _error(capsys, ["plan", "qwen3-8b", *SMALL, "--fsdp", "-1"])
    assert "--fsdp must be >= 0 (0: not wrapped), got -1" in err


def test_fsdp_on_one_rank_plans_its_gathered_copies(capsys):
    """`--fsdp 1` (FSDP2 at world size 1, examples/accelerate/fsdp2.yaml on one process) is a wrapped model, not the
    default unwrapped one: its gathered root and layers and its unsharded gradients come on top of the same weights."""
    _, plain = _plan_json(capsys, ["qwen3-8b", *SMALL, "--lora-rank", "16"])
    _, wrapped = _plan_json(capsys, ["qwen3-8b", *SMALL, "--lora-rank", "16", "--fsdp", "1"])
    assert wrapped["weights"] == plain["weights"] and plain["fsdp_gathered"] == 0
    # the generation's gathered units take what the card has free, beyond the plan: the plan says so
    assert any("generation_fsdp_gather_gib" in n for n in wrapped["notes"])
    assert not any("generation_fsdp_gather_gib" in n for n in plain["notes"])
    assert wrapped["fsdp_gathered"] > GiB  # the 8B's embedding and head alone are 2.3 GiB
    # the capture holds two gathered layers at its peak, the replays the root (embedding, head) too
    assert 0 < wrapped["fsdp_gathered_in_capture"] < wrapped["fsdp_gathered"]
    assert wrapped["capture_peak"] - plain["capture_peak"] == wrapped["fsdp_gathered_in_capture"]
    assert (
        wrapped["replay_peak"] - plain["replay_peak"]
        == wrapped["fsdp_gathered"] + wrapped["fsdp_unsharded_gradients"]
    )


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


def _config_dir(tmp_path, name: str, **overrides):
    """A small Qwen3 config.json (2 layers) with ``overrides``, as a model directory to plan."""
    from transformers import Qwen3Config

    path = tmp_path / name
    Qwen3Config(
        num_hidden_layers=2,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        **overrides,
    ).save_pretrained(path)
    return str(path)


def test_positions_beyond_max_position_embeddings_do_not_run(tmp_path, capsys):
    """A model with 8K positions fits in memory at 1M tokens, but the engine would refuse it: the plan says so,
    names the limit and the change (a YaRN factor and max_position_embeddings, or the longest prompt), exit 1."""
    model = _config_dir(tmp_path, "m8k", max_position_embeddings=8192)
    status, plan = _plan_json(capsys, [model, "--prompt", "1048576"])
    assert plan["fits"] and status == 1 and not plan["runs"]
    positions = plan["positions"]
    assert positions["limit"] == 8192 and positions["limited_by"] == "max_position_embeddings"
    (problem,) = positions["problems"]
    assert "1,050,624 > max_position_embeddings = 8,192" in problem
    assert '"rope_type": "yarn", "factor": 129.0' in problem and "at most 6,144" in problem
    assert main(["plan", model, "--prompt", "1048576"]) == 1
    text = capsys.readouterr().out
    assert "->  FITS" in text and "the model takes 8,192 (max_position_embeddings)  ->  DOES NOT RUN" in text
    # within the positions: it runs
    status, plan = _plan_json(capsys, [model, "--prompt", "6144"])
    assert status == 0 and plan["runs"] and plan["positions"]["ok"]
    assert _plan_json(capsys, [model, "--prompt", "6145"])[0] == 1
    # --max-prompt stops at the positions, not at the memory
    status, plan = _plan_json(capsys, [model, "--max-prompt"])
    assert status == 0 and plan["prompt_tokens"] == 6144


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_yarn_reach_and_max_position_embeddings(tmp_path, capsys, key):
    """Qwen's YaRN recipe (factor 4 over 32,768) reaches 131,072 positions; with max_position_embeddings left at
    40,960 the engine still refuses more than that, so the plan says to raise it; past the YaRN's reach, to raise
    the factor. Written as transformers 5's rope_parameters or a transformers 4 config's rope_scaling."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    path = tmp_path / key
    path.mkdir()
    config = json.loads(Path(_config_dir(tmp_path, "base")).joinpath("config.json").read_text())
    config.pop("rope_parameters", None)
    config.update({"max_position_embeddings": 40960, "rope_theta": 1e6, key: yarn})
    (path / "config.json").write_text(json.dumps(config))
    _, plan = _plan_json(capsys, [str(path), "--prompt", "100000"])
    positions = plan["positions"]
    assert positions["limit"] == 40960 and "reaches 131,072" in positions["rope"][0]
    (problem,) = positions["problems"]
    assert "the RoPE scaling reaches 131,072: set max_position_embeddings >= 102,048" in problem
    config["max_position_embeddings"] = 131072
    (path / "config.json").write_text(json.dumps(config))
    status, plan = _plan_json(capsys, [str(path), "--prompt", "100000"])
    assert status == 0 and plan["positions"]["ok"]
    config["max_position_embeddings"] = 1 << 21  # positions allowed, but past the YaRN's reach
    (path / "config.json").write_text(json.dumps(config))
    status, plan = _plan_json(capsys, [str(path), "--prompt", "1048576"])
    positions = plan["positions"]
    assert status == 1 and positions["limit"] == 131072 and positions["limited_by"] == "the YaRN scaling"
    (problem,) = positions["problems"]
    assert "reaches 131,072 positions < P + R = 1,050,624: set its factor to 33.0 or more" in problem


def test_rope_per_layer_type_and_call_dependent_rope(tmp_path, capsys):
    """transformers 5 nests RoPE per layer type (Gemma 3): the full layers' RoPE is checked, the sliding layers'
    is not a limit; a 'dynamic' RoPE is refused by the engine at any length, and the plan says so."""
    from transformers import Gemma3TextConfig

    path = tmp_path / "gemma3"
    Gemma3TextConfig(
        num_hidden_layers=2,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1 << 21,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": 8.0,
                "original_max_position_embeddings": 32768,
            },
        },
    ).save_pretrained(path)
    status, plan = _plan_json(capsys, [str(path), "--prompt", "524288"])
    positions = plan["positions"]
    assert positions["limit"] == 262144 and status == 1
    assert any(r.startswith("sliding_attention: ") and "not a limit" in r for r in positions["rope"])
    (problem,) = positions["problems"]
    assert "full_attention" in problem and "factor to 17.0 or more" in problem
    dynamic = _config_dir(
        tmp_path, "dynamic", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}
    )
    status, plan = _plan_json(capsys, [dynamic, "--prompt", "1024"])
    (problem,) = plan["positions"]["problems"]
    assert status == 1 and "rope_type='dynamic' is refused" in problem and "use 'yarn'" in problem


def test_offload_only_within_the_host_memory(capsys):
    """`--offload cpu` is suggested, and planned as fitting, only within this rank's share of --host-memory: 100M
    tokens of Qwen3-8B (13.7 TB of K/V) do not get a bare `--offload cpu`, but one spread over enough CP ranks."""
    argv = ["qwen3-8b", "--prompt", "100000000", "--gpu", "80"]
    status, plan = _plan_json(capsys, argv)
    assert status == 1
    share = 2048 / 8 * 2**30  # the default: a 2 TiB host shared by 8 ranks
    offloads = [s for s in plan["suggestions"] if "--offload" in s["args"]]
    assert offloads and ["--offload", "cpu"] not in [s["args"] for s in plan["suggestions"]]
    for s in offloads:
        assert 0 < s["host_bytes"] <= share, s
    status, off = _plan_json(capsys, [*argv, "--offload", "cpu"])
    assert status == 1 and off["fits_gpu"] and not off["fits_host"] and off["host_state"] > share
    assert main(["plan", *argv, "--offload", "cpu"]) == 1
    assert "host memory             256.00 GiB  ->  DOES NOT FIT" in capsys.readouterr().out
    # a larger host (or fewer ranks on it) holds more: 1M tokens' 144 GiB fit one rank of a 1 TiB host only alone
    small = ["qwen3-8b", "--prompt", "1048576", "--gpu", "80", "--offload", "cpu", "--lora-rank", "64"]
    assert _plan_json(capsys, [*small, "--host-memory", "1024"])[0] == 1
    status, plan = _plan_json(capsys, [*small, "--host-memory", "1024", "--ranks-per-host", "1"])
    assert status == 0 and plan["host_memory"] == 1024 * 2**30


def test_bad_host_memory(capsys):
    err = _error(capsys, ["plan", "qwen3-8b", *SMALL, "--host-memory", "0"])
    assert "--host-memory must be a positive number of GiB" in err


def test_default_plan_is_of_the_trainers_default_chunk_and_page(capsys):
    """With no --chunk-size / --page-size the plan is of what `LongStrawGRPOConfig`'s defaults run (the CLI once
    planned 16K chunks against the trainer's 8K)."""
    import dataclasses

    from longstraw_trl import LongStrawGRPOConfig
    from longstraw_trl.constants import AUTO_PREFERRED

    defaults = {f.name: f.default for f in dataclasses.fields(LongStrawGRPOConfig)}
    # "auto": the value the trainer takes where the step fits with it (--chunk-size auto plans the search)
    chunk = (
        AUTO_PREFERRED["capture_chunk_size"]
        if defaults["capture_chunk_size"] == "auto"
        else defaults["capture_chunk_size"]
    )
    page = defaults["page_size"]
    argv = ["qwen3-8b", *SMALL, "--lora-rank", "16"]
    _, default = _plan_json(capsys, argv)
    _, trainers = _plan_json(capsys, [*argv, "--chunk-size", str(chunk), "--page-size", str(page)])
    _, doubled = _plan_json(capsys, [*argv, "--chunk-size", str(2 * chunk)])
    assert default == trainers
    assert doubled["capture_workspace"] > default["capture_workspace"]  # the chunk shows in the plan


def test_keep_layers_on_device_plans_the_trainers_placement(capsys):
    """`--keep-layers-on-device` (the trainer's offload_keep_layers_on_device): whole K/V layers of the offloaded
    27B state at 512K stay on an H100 within 90% of what the offloaded plan leaves free; the rest stays on the host."""
    argv = ["qwen3.6-27b", "--prompt", "524288", "--response", "32", "--lora-rank", "64", "--gpu", "h100"]
    argv += ["--offload", "cpu"]
    _, streamed = _plan_json(capsys, argv)
    status, kept = _plan_json(capsys, [*argv, "--keep-layers-on-device"])
    assert status == 0 and streamed["fits"] and kept["fits"]
    free = streamed["gpu_bytes"] - max(streamed["capture_peak"], streamed["replay_peak"])
    moved = streamed["host_state"] - kept["host_state"]
    assert 0 < moved <= 0.9 * free and kept["device_state"] - streamed["device_state"] == moved
    assert kept["state"] == streamed["state"] and kept["offload_workspace"] == streamed["offload_workspace"]
    assert main(["plan", *argv, "--keep-layers-on-device"]) == 0
    assert "of whole layers kept on the device (device_state_bytes)" in capsys.readouterr().out


def test_auto_settings_plan_what_the_trainer_chooses(capsys):
    """`--replay-batch-tokens auto` / `--chunk-size auto` (the trainer's defaults): the 27B at 128K with R = 4,096
    does not fit an H100 replaying two responses together; "auto" replays one at a time instead, and fits."""
    argv = ["qwen3.6-27b", "--prompt", "131072", "--response", "4096", "--lora-rank", "64", "--gpu", "h100"]
    status, given = _plan_json(capsys, argv)
    assert status == 1 and not given["fits"]
    status, auto = _plan_json(capsys, [*argv, "--replay-batch-tokens", "auto", "--chunk-size", "auto"])
    assert status == 0 and auto["fits"] and auto["suggestions"] == []
    assert auto["auto_settings"] == {"capture_chunk_size": 8192, "replay_batch_tokens": 4096}
    status, same = _plan_json(capsys, [*argv, "--replay-batch-tokens", "4096"])
    assert status == 0 and same["replay_peak"] == auto["replay_peak"]  # the plan of the chosen value
    with pytest.raises(SystemExit):
        main(["plan", *argv, "--chunk-size", "big"])


def test_keep_layers_on_device_leaves_the_full_gradient_on_the_host(capsys):
    """The full gradient's dK/dV buffers follow their pages: with --gradient-mode full every layer stays offloaded."""
    argv = ["qwen3.6-27b", "--prompt", "262144", "--response", "32", "--lora-rank", "64", "--gpu", "h100"]
    argv += ["--offload", "cpu", "--gradient-mode", "full"]
    _, streamed = _plan_json(capsys, argv)
    _, kept = _plan_json(capsys, [*argv, "--keep-layers-on-device"])
    assert kept["host_state"] == streamed["host_state"] > 0 and kept["replay_peak"] == streamed["replay_peak"]
