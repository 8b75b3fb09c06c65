"""The device benchmarks' own dry runs (``--tiny``, CPU): a script that breaks here would waste device time.

Each run writes its JSON to a temporary $OUT; the test reads it back and checks the fields that
bench/plot.py, docs/performance.md's tables and tests/test_planner.py rely on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

BENCH = Path(__file__).parent.parent / "bench"


def _run(tmp_path: Path, *args: str, ok: bool = True) -> None:
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=BENCH,
        env={**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert (proc.returncode == 0) == ok, f"stdout: {proc.stdout[-1500:]}\nstderr: {proc.stderr[-3000:]}"


def test_engine_slice_dry_run(tmp_path):
    _run(tmp_path, "engine_slice.py", "--tiny", "--preset", "qwen3.6-27b", "--prompt", "1024", "--groups", "2",
         "--response", "8", "--chunk", "256", "--page", "256", "--tag", "_t")  # fmt: skip
    data = json.loads((tmp_path / "engine_qwen3.6-27b_4L_t.json").read_text())
    assert data["command"] and data["git_revision"] and data["date"] and data["device"].startswith("cpu")
    assert data["small_check_max_abs_logprob_diff_bf16"] < 0.05  # bf16 log-probs against the stock forward
    (r,) = data["results"]
    assert r["prompt_tokens"] == 1024 and r["state_bytes"] == sum(r["state_bytes_by_kind"].values())
    assert r["generation"]["G"] == 2 and r["replays"][0]["G"] == 2
    assert not data["gradients_kept_during_capture"]


def test_compare_stock_dry_run(tmp_path):
    _run(tmp_path, "compare_stock.py", "--tiny", "--preset", "qwen3-8b", "--prompts", "256", "--groups", "2",
         "--response", "8", "--chunk", "128", "--page", "128", "--stock-sequences", "1")  # fmt: skip
    data = json.loads((tmp_path / "compare_stock_qwen3-8b_4L.json").read_text())
    assert data["activation_checkpointing"]
    (r,) = data["results"]
    assert r["stock"]["ok"] and r["stock"]["sequences_run"] == 1 and "step_s_projected" in r["stock"]
    assert r["longstraw"]["ok"] and r["longstraw"]["sequences_run"] == 2
    assert r["stock_over_longstraw"] is None and r["stock_projected_over_longstraw"] > 0


def test_cp_slice_dry_run_two_ranks(tmp_path):
    # --tee 3: every line of a rank's stdout/stderr (C++ included) prefixed "[default<rank>]:", so a failure names
    # the process that printed it (an unprefixed line is torchrun's own); one run on a clean clone aborted with
    # gloo's "terminate called without an active exception", not reproduced since (the exit
    # paths are now covered by bench/common.py's process_group, tested below); --standalone: a free port, so that
    # tests launched side by side (pytest-xdist) do not collide on torchrun's default 29500
    _run(tmp_path, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--tee", "3", "cp_slice.py", "--tiny",
         "--prompt", "1500", "--response", "8", "--generations", "2", "--cycles", "2", "--chunk", "512",
         "--page", "256")  # fmt: skip
    data = json.loads((tmp_path / "cp2_qwen3.6-27b_4L_P1500.json").read_text())
    assert data["check_grads_identical_across_ranks"]
    assert data["check_max_abs_logprob_diff_sharded_vs_single"] <= 1e-2  # bf16 model
    ranks = data["ranks"]
    assert len(ranks) == 2 and all(len(r["replay_peak_gib_per_cycle"]) == 2 for r in ranks)
    assert sum(r["state_bytes_by_kind"]["kv"] for r in ranks) > 0
    assert set(data["planner_full_model"]) and all(
        v["layers"] == 64 for v in data["planner_full_model"].values()
    )


def _bench_common():
    spec = importlib.util.spec_from_file_location("bench_common", BENCH / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("fails", [False, True])
def test_bench_process_group_left_on_every_exit(tmp_path, fails):
    # cp_slice's ranks run inside process_group(): a rank must not reach interpreter shutdown with the group
    # (and gloo's threads) alive, on success or on an exception; a one-rank gloo group
    process_group = _bench_common().process_group
    store = f"file://{tmp_path / 'store'}"
    try:
        if fails:
            with (
                pytest.raises(ValueError, match="rank failed"),
                process_group("gloo", init_method=store, rank=0, world_size=1),
            ):
                assert dist.is_initialized()
                raise ValueError("rank failed")
        else:
            with process_group("gloo", init_method=store, rank=0, world_size=1):
                assert dist.is_initialized() and dist.get_world_size() == 1
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():  # a failed check must not leave the group to later tests
            dist.destroy_process_group()


def test_full_model_dry_run(tmp_path):
    # the 4M points must be skipped by their time estimates (and never built): the budget logic runs too
    _run(tmp_path, "full_model.py", "--tiny", "--prompts", "512", "1024", "4194304",
         "--stock-prompts", "256", "512", "4194304", "--tag", "_t")  # fmt: skip
    data = json.loads((tmp_path / "full_model_qwen3.6-27b_tiny_t.json").read_text())
    assert data["command"] and data["git_revision"] and data["date"] and data["device"].startswith("cpu")
    assert data["params"]["lora_params"] > 0 and data["rates"]["attention_tflops"] > 0
    assert data["longstraw_warmup"]["ok"]
    *measured, skipped = data["longstraw"]
    assert [r["prompt_tokens"] for r in measured] == [512, 1024] and skipped["skipped"] == "budget"
    for r in measured:
        assert r["ok"] and r["prompt_tokens_captured"] == r["prompt_tokens"]
        assert r["response_tokens_min_max"] == [8, 8]  # no reachable EOS: every response has R tokens
        assert r["state_bytes"] == sum(r["state_bytes_by_kind"].values()) > 0
        for phase in ("capture", "generation", "replay"):
            p = r["phases"][phase]
            assert p["seconds"] > 0 and p["floor_s"] > 0 and p["over_floor"] == p["seconds"] / p["floor_s"]
        assert r["planner"]["peak_gib"] > 0 and "peak_gib" in r
        # the capture chunk by chunk (P - 1 resident tokens in chunks of 128), within the capture's seconds
        assert len(r["capture_chunk_s"]) == -(-(r["prompt_tokens"] - 1) // 128)
        assert 0 < sum(r["capture_chunk_s"]) <= r["phases"]["capture"]["seconds"]
    assert measured[1]["estimate_s"] > 0  # from the first measured step
    stock = data["stock"]
    assert stock["largest_fitting_prompt"] == 512 and stock["largest_fitting_step_s"] > 0
    assert stock["first_oom_prompt"] is None and stock["stopped_by"] == "budget"
    assert [r.get("ok") for r in stock["results"]] == [True, True, False] and stock["results"][2]["skipped"]


def test_full_model_library_defaults_leave_memory_settings_to_the_preflight_plan(tmp_path):
    # --library-defaults: the trainer's memory settings stay "auto"; under a GPU budget just below the preferred
    # plan's peak the pre-flight chooses other settings, the step runs with them and the record says what it chose;
    # the bench's plan is the pre-flight's. Negative control: the bench's explicit settings are refused there.
    def step(tag, *extra, ok=True):
        _run(tmp_path, "full_model.py", "--tiny", "--skip-stock", "--prompts", "512", "--warmup-prompt", "0",
             "--tag", tag, *extra, ok=ok)  # fmt: skip
        return json.loads((tmp_path / f"full_model_qwen3.6-27b_tiny{tag}.json").read_text())["longstraw"][0]

    roomy = step("_roomy", "--library-defaults", "--preflight-gpu-memory-gib", "1000")
    assert roomy["configured"]["offload_prompt_state"] == roomy["configured"]["replay_batch_tokens"] == "auto"
    assert roomy["preflight"]["settings"] == {} and roomy["preflight"]["offload_prompt_state"] is None
    budget = str(roomy["preflight"]["resident_peak_gib"] - 1e-6)
    tight = step("_tight", "--library-defaults", "--preflight-gpu-memory-gib", budget)
    chose = tight["preflight"]
    assert tight["ok"] and (chose["settings"] or chose["offload_prompt_state"] == "cpu"), chose
    assert chose["planned_peak_gib"] <= float(budget)
    assert tight["planner"]["peak_gib"] == pytest.approx(chose["planned_peak_gib"], rel=1e-9)
    refused = step("_explicit", "--preflight-gpu-memory-gib", budget, ok=False)
    assert not refused["ok"] and refused["error"].startswith("PreflightError") and "configured" not in refused


def test_full_model_dry_run_full_mode_segments_and_kernel_rate_floor(tmp_path):
    # the full mode's prompt backward: every segment timed, the middle one profiled, and its floor also at the
    # measured page-backward rate (the same FLOPs at the speed of the kernel that runs them)
    _run(tmp_path, "full_model.py", "--tiny", "--skip-stock", "--prompts", "512", "--gradient-modes", "full",
         "--profile-segment", "5", "--tag", "_pb")  # fmt: skip
    data = json.loads((tmp_path / "full_model_qwen3.6-27b_tiny_pb.json").read_text())
    assert data["rates"]["attention_backward_tflops"] > 0
    assert data["rates"]["attention_backward_queries_keys"] == [data["capture_chunk_size"], data["page_size"]]
    (r,) = data["longstraw"]
    pb = r["phases"]["prompt_backward"]
    assert r["ok"] and pb["seconds"] > 0 and pb["floor_s"] > 0 and pb["floor_at_kernel_rates_s"] > 0
    assert pb["over_floor_at_kernel_rates"] == pb["seconds"] / pb["floor_at_kernel_rates_s"]
    # one segment a capture chunk (P - 1 resident tokens in chunks of 128), each timed; the middle one profiled
    assert len(r["segment_s"]) == -(-(r["prompt_tokens"] - 1) // 128) and sum(r["segment_s"]) <= pb["seconds"]
    # last to first, each by its first token: what a step cut by the timeout leaves in its entry's "partial"
    assert r["segment_start_tokens"] == list(range(0, r["prompt_tokens"] - 1, 128))[::-1]
    assert r["segment_profile"]["segment_index"] == len(r["segment_s"]) // 2
    assert r["segment_profile"]["families"] and len(r["segment_profile"]["top_kernels"]) <= 5
    ops = r["segment_profile"]["top_ops"]  # the ops that launched the kernels, with their input shapes
    assert 0 < len(ops) <= 5 and all(o["op"].startswith("aten::") and o["shapes"] for o in ops)
    assert 0 < r["capture_peak_gib"] <= r["peak_before_prompt_backward_gib"] <= r["trainer_peak_memory_gib"]


def test_full_model_dry_run_under_fsdp2_at_world_size_one(tmp_path):
    """`python3 bench/run.py fsdp --mode world1`'s path (examples/accelerate/fsdp2.yaml on one process): the warm-up trainer
    shards the model, the measured step's fresh trainer runs on it, and the plan is FSDP2's (its gathered layers and
    unsharded gradients on top of the unwrapped plan's)."""
    config = BENCH.parent / "examples" / "accelerate" / "fsdp2.yaml"
    shim = Path(__file__).parent / "_fsdp_bench.py"  # FSDP2 on the CPU, as the tests' FSDP launches do
    _run(tmp_path, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "1",
         "--main_process_port", "0", str(shim), "full_model.py", "--tiny", "--skip-stock", "--prompts", "512",
         "--tag", "_fsdp1")  # fmt: skip
    data = json.loads((tmp_path / "full_model_qwen3.6-27b_tiny_fsdp1.json").read_text())
    assert data["longstraw_warmup"]["ok"]
    (step,) = data["longstraw"]
    assert step["ok"] and step["prompt_tokens_captured"] == 512
    assert step["planner"]["fsdp_size"] == 1 and step["planner"]["fsdp_gathered_gib"] > 0


def test_full_model_dry_run_fully_fine_tuned_under_fsdp2_x_cp2(tmp_path):
    """`python3 bench/run.py fsdp --mode fsdp2-cp8`'s path on two CPU processes: the whole model trained (--lora-rank 0, no
    adapters) under fsdp2.yaml with cp_size=2, its floors counting every decoder parameter as trained, its plan
    FSDP2's over both ranks."""
    config = BENCH.parent / "examples" / "accelerate" / "fsdp2.yaml"
    shim = Path(__file__).parent / "_fsdp_bench.py"
    _run(tmp_path, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "2",
         "--main_process_port", "0", str(shim), "full_model.py", "--tiny", "--skip-stock", "--prompts", "512",
         "--lora-rank", "0", "--cp-size", "2", "--tag", "_fsdp2_cp2_fft")  # fmt: skip
    data = json.loads((tmp_path / "full_model_qwen3.6-27b_tiny_fsdp2_cp2_fft.json").read_text())
    assert data["model"].endswith("full fine-tuning")
    params = data["params"]  # nothing frozen: every decoder parameter and the head are trained
    assert params["decoder_params"] == 0 and params["lora_params"] > 0 and params["head_trained"]
    assert data["longstraw_warmup"]["ok"]
    (step,) = data["longstraw"]
    assert step["ok"] and step["prompt_tokens_captured"] == 512
    assert step["planner"]["fsdp_size"] == 2


def test_full_model_dry_run_glm5_slice_under_ep2_x_cp2(tmp_path):
    """`python3 bench/run.py glm --train --ranks 8`'s path on two CPU processes: a GLM-5 slice (layer 0 dense, two MoE
    layers of 8 experts) through train() with its experts split over the CP group (EP2 x CP2 under cp2.yaml's bf16
    autocast), LoRA kept off the experts, in both gradient modes; every rank reports its own peak and state, and holds
    half the experts."""
    config = BENCH.parent / "examples" / "accelerate" / "cp2.yaml"
    _run(tmp_path, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "2",
         "--main_process_port", "0", "full_model.py", "--tiny", "--preset", "glm-5", "--layers", "3", "--skip-stock",
         "--prompts", "512", "--cp-size", "2", "--ep-size", "2", "--gradient-modes", "response_only", "full",
         "--tag", "_ep2_cp2")  # fmt: skip
    data = json.loads((tmp_path / "full_model_glm-5_tiny_ep2_cp2.json").read_text())
    # LoRA on the attention, not the experts
    assert "mlp" not in data["model"] and "q_a_proj" in data["model"] and "the weights" not in data["model"]
    assert data["longstraw_warmup"]["ok"]
    step, full = data["longstraw"]
    assert full["ok"] and full["gradient_mode"] == "full" and full["phases"]["prompt_backward"]["seconds"] > 0
    assert step["ok"] and step["prompt_tokens_captured"] == 512
    # GLM-5: no floors here
    assert step["step_floor_s"] is None and step["phases"]["capture"]["over_floor"] is None
    assert step["expert_parallel"]["experts_here"] == [4] and step["expert_parallel"]["experts"] == [8]
    ranks = step["by_rank"]
    assert [r["rank"] for r in ranks] == [0, 1]
    # each rank holds its own pages: the two states are different parts of one prompt's
    assert all(r["state_bytes"] > 0 for r in ranks) and step["state_bytes"] == ranks[0]["state_bytes"]


@pytest.mark.slow  # a subprocess that mostly imports (time budget); run before a device run
def test_prefix_tree_smoke(tmp_path):
    _run(tmp_path, "prefix_tree.py", "--smoke")
    data = json.loads((tmp_path / "prefix_tree_qwen3.6-27b_4L_smoke.json").read_text())
    points, turn, tail, chunk = data["points"], data["turn_tokens"], data["tail_tokens"], data["chunk"]
    last = data["trajectory_tokens"] + tail
    # the trie: one trunk per point but the last, nested; each point then extends only its question
    assert data["trunks"] == [data["trajectory_tokens"] - (points - 1 - k) * turn for k in range(points - 1)]
    batch = {r["point"]: r["prefilled"] for r in data["rows"] if r["mode"] == "batch"}
    assert batch["trunk"] == data["trunks"][-1] and all(batch[k] == tail for k in range(points - 1))
    assert batch[points - 1] == turn + tail
    steps = [r["prefilled"] for r in data["rows"] if r["mode"] == "steps"]
    assert steps[0] == last - (points - 1) * turn and all(0 < n <= turn + tail + chunk for n in steps[1:])
    assert data["max_abs_logprob_diff_vs_whole"] < 1e-4  # fp32 on the CPU
    assert {s["mode"] for s in data["summary"]} == {"batch", "steps"}


def test_agent_turns_dry_run(tmp_path):
    _run(tmp_path, "agent_turns.py", "--tiny", "--prompt", "600", "--generations", "2", "--turns", "2",
         "--response", "6", "--tool-tokens", "10", "--chunk", "256", "--page", "128")  # fmt: skip
    data = json.loads((tmp_path / "agent_turns_qwen3.6-27b_4L_tiny.json").read_text())
    assert data["captures"] == [600]  # the prompt, once
    turns = data["turns_table"]
    assert [t["prefilled_tokens"] for t in turns] == [
        600,
        2 * 16,
        2 * 16,
    ]  # then only completion + tool tokens
    assert data["replay"]["tokens"] == 6 + 2 * (10 + 6)


def test_full_gradient_smoke(tmp_path):
    _run(tmp_path, "full_gradient.py", "--smoke")
    data = json.loads((tmp_path / "full_gradient_qwen3.6-27b_4L.json").read_text())
    check = data[
        "check_bf16"
    ]  # bf16: the full gradient near the stock one, the response-only one far from it
    assert check["full_rel_l2_vs_stock_full"] < 0.05 < check["response_only_rel_l2_vs_stock_full"]
    full, response_only = data["steps"]
    assert (full["mode"], response_only["mode"]) == ("full", "response_only")
    assert (
        full["prompt_backward_s"] > 0 and full["kept_boundaries"] == 3 and full["gradient_buffer_bytes"] > 0
    )
    assert full["step_s"] == full["capture_s"] + full["replay_s_total"] + full["prompt_backward_s"]
    assert [r["replay"] for r in data["long_response"]] == ["blocks", "whole"]
    assert all(r["ok"] for r in data["long_response"])


def test_glm_slice_smoke(tmp_path):
    _run(tmp_path, "glm_slice.py", "--smoke", "--prompt", "300", "--response", "12", "--groups", "2",
         "--chunk", "128", "--page", "128", "--offload-gen-tokens", "3", "--warmup-prompt", "200",
         "--tag", "_t")  # fmt: skip
    data = json.loads((tmp_path / "glm_slice_3L_t.json").read_text())
    assert len(data["warmup_s"]) == 2  # one unmeasured case a storage
    assert data["command"] and data["git_revision"] and data["device"].startswith("cpu")
    assert data["indexer_types"] == ["full", "shared", "shared"] and data["skipped"] == []
    small = data["small_check_abs_logprob_diff_bf16"]  # bf16: all keys kept, then index_topk below the length
    assert small["all_keys_max"] < 0.05 and small["index_topk_max"] < 0.05
    gpu, host = data["results"]
    assert gpu["state_bytes_gpu"] == host["state_bytes_host"] == sum(gpu["state_bytes_by_kind"].values()) > 0
    assert set(gpu["state_bytes_by_kind"]) == {"mla", "indexer"} and host["state_bytes_gpu"] == 0
    assert gpu["generation_tokens"] == 12 and host["generation_tokens"] == 3
    assert gpu["generation_cuda_graph"] is host["generation_cuda_graph"] is False  # (CPU: no graphs)
    for r in (gpu, host):
        assert r["capture_floor_s"] > 0 and r["replay_floor_s"] > 0 and r["generation_floor_s_R"] > 0
        assert r["replay_over_floor"] == r["replay_s_per_response"] / r["replay_floor_s"]
        # decode seconds per token: the difference of a half call and a whole one (or, inverted, the whole's)
        assert 0 < r["generation_s_per_token"] and r["generation_s_half_call"] > 0
        if not r["generation_per_token_is_marginal"]:
            assert r["generation_s_per_token"] == r["generation_s_per_token_whole_call"]
    # bytes of offloaded state streamed back to the device, per phase: none with the state on the device
    assert gpu["h2d_bytes_capture"] == gpu["h2d_bytes_per_response"] == gpu["h2d_bytes_per_token"] == 0
    assert (
        host["h2d_bytes_capture"] > 0
        and host["h2d_bytes_per_response"] > 0
        and host["h2d_bytes_per_token"] > 0
    )
    assert (
        len(gpu["capture_chunk_s"]) == len(host["capture_chunk_s"]) == 3
    )  # 299 resident tokens, chunks of 128
    overlap = host["copy_overlap"]  # paired with this run's GPU case at the same P
    assert {"capture", "replay, per response"} <= set(overlap)
    assert all(v["copy_s"] > 0 and 0 <= v["hidden"] <= 1 for v in overlap.values())


def test_glm_host_case_pairs_with_a_reference_file(tmp_path):
    """A host-state run alone takes its GPU-state pair from an earlier run's JSON (a missing file: no pair)."""
    args = ("--smoke", "--prompt", "300", "--response", "12", "--groups", "2", "--chunk", "128", "--page", "128",
            "--offload-gen-tokens", "3")  # fmt: skip
    _run(tmp_path, "glm_slice.py", *args, "--storage", "gpu", "--tag", "_gpu")
    reference = tmp_path / "glm_slice_3L_gpu.json"
    _run(
        tmp_path,
        "glm_slice.py",
        *args,
        "--storage",
        "cpu",
        "--tag",
        "_host",
        "--gpu-reference",
        str(reference),
    )
    (host,) = json.loads((tmp_path / "glm_slice_3L_host.json").read_text())["results"]
    assert host["state_bytes_host"] > 0 and {"capture", "replay, per response"} <= set(host["copy_overlap"])
    _run(tmp_path, "glm_slice.py", *args, "--storage", "cpu", "--tag", "_alone", "--gpu-reference",
         str(tmp_path / "missing.json"))  # fmt: skip
    (alone,) = json.loads((tmp_path / "glm_slice_3L_alone.json").read_text())["results"]
    assert "copy_overlap" not in alone


def test_glm_copy_overlap_formula(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    from glm_slice import copy_overlap

    gpu = {"capture_s": 10.0, "replay_s_per_response": 1.0, "generation_s_per_token": 0.01}
    host = {"capture_s": 12.0, "h2d_bytes_capture": 4e9, "replay_s_per_response": 0.9,
            "h2d_bytes_per_response": 1e9, "generation_s_per_token": 0.05, "h2d_bytes_per_token": 1e7}  # fmt: skip
    got = copy_overlap(host, gpu, h2d_gbs=1.0)
    assert got["capture"] == {"copy_s": 4.0, "extra_s": 2.0, "hidden": 0.5}
    assert got["replay, per response"]["hidden"] == 1.0  # faster than the GPU case: all hidden (clamped)
    assert "decode, per token" not in got  # neither case timed decode as a marginal cost
    host["generation_per_token_is_marginal"] = gpu["generation_per_token_is_marginal"] = True
    assert copy_overlap(host, gpu, h2d_gbs=1.0)["decode, per token"]["hidden"] == 0.0  # 40 ms extra for 10 ms


def test_full_model_step_cut_short_leaves_its_finished_phases(tmp_path, monkeypatch):
    """A step that dies after generation (the device command's timeout) leaves its capture and generation seconds
    in the JSON, under the entry still marked running."""
    import pytest

    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.chdir(BENCH)
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "full_model.py",
            "--tiny",
            "--prompts",
            "512",
            "--warmup-prompt",
            "0",
            "--skip-stock",
            "--tag",
            "_cut",
        ],
    )
    import full_model

    from longstraw_trl.trainer import LongStrawGRPOTrainer

    def cut(self, *args, **kwargs):
        raise KeyboardInterrupt("the command's timeout")

    monkeypatch.setattr(LongStrawGRPOTrainer, "micro_batch_loss", cut)
    with pytest.raises(KeyboardInterrupt):
        full_model.main()
    entry = json.loads((tmp_path / "full_model_qwen3.6-27b_tiny_cut.json").read_text())["longstraw"][0]
    assert entry["status"] == "running"
    partial = entry["partial"]
    assert (
        len(partial["longstraw/capture_seconds"]) == 1 and len(partial["longstraw/generation_seconds"]) == 1
    )


@pytest.mark.slow  # two full_model.py --tiny processes: ~3 min on 2 cores
def test_cold_start_dry_run(tmp_path):
    _run(tmp_path, "cold_start.py", "--tiny")
    data = json.loads((tmp_path / "cold_start_qwen3.6-27b.json").read_text())
    assert [c["case"] for c in data["cases"]] == ["cold", "disk cache"]
    for case in data["cases"]:
        assert case["returncode"] == 0 and len(case["steps"]) == 2 and all(s["ok"] for s in case["steps"])
        assert case["steps"][0]["phases"]["capture"]["seconds"] > 0
        # the stack sampler saw both steps (where step 1 spent more than step 2, innermost frames first)
        stacks = case["first_step_extra_by_stack"]
        assert stacks and sum(r["step1_s"] for r in stacks) > 0 and sum(r["step2_s"] for r in stacks) > 0


def _trl_grpo_tests_module():
    spec = importlib.util.spec_from_file_location("trl_grpo_tests", BENCH / "trl_grpo_tests.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trl_grpo_tests_bookkeeping(tmp_path):
    """bench/trl_grpo_tests.py: a test's newest JSON line counts, and names its run; `--seed` fills in only the tests a
    side has not run yet, as one more entry of the invocation log."""
    runner = _trl_grpo_tests_module()
    rows = [
        {"test": "T::a", "outcome": "failed", "message": "first", "run": 0},
        {"test": "T::b", "outcome": "passed", "message": ""},  # written before lines named their run
        {"test": "T::a", "outcome": "passed", "message": "", "run": 1},
    ]
    (tmp_path / "results_stock.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "invocations.jsonl").write_text(
        json.dumps({"command": "x"}) + "\n" + json.dumps({"command": "y"}) + "\n"
    )
    parsed = runner.parse_results(tmp_path / "results_stock.jsonl")
    assert parsed["T::a"] == {"outcome": "passed", "message": "", "run": 1}
    assert parsed["T::b"]["run"] == 0

    earlier = {
        "command": "old",
        "git_revision": "abc",
        "date": "then",
        "tests": {
            name: {"stock": "skipped", "ours": "failed", "stock_message": "s", "ours_message": "o"}
            for name in ("T::a", "T::c")
        },
    }
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    runner.seed(tmp_path, tmp_path / "earlier.json")
    log = [json.loads(line) for line in (tmp_path / "invocations.jsonl").read_text().splitlines()]
    index = len(log) - 1
    assert log[index]["seeded_from"] == str(tmp_path / "earlier.json")
    assert log[index]["invocations"] == [{"command": "old"}]
    stock = runner.parse_results(tmp_path / "results_stock.jsonl")
    ours = runner.parse_results(tmp_path / "results_ours.jsonl")
    assert stock["T::a"] == parsed["T::a"]  # run here: kept
    assert stock["T::c"] == {"outcome": "skipped", "message": "s", "run": index}
    assert set(ours) == set(earlier["tests"]) and all(
        r == {"outcome": "failed", "message": "o", "run": index} for r in ours.values()
    )


def test_segment_ops_dry_run(tmp_path):
    """bench/segment_ops.py (the full mode's prompt-backward ops per layer per segment, by family and source) runs on
    a two-layer hybrid and names the families it counted."""
    proc = subprocess.run(
        [
            sys.executable,
            "segment_ops.py",
            "--layers",
            "GF",
            "--dtype",
            "fp32",
            "--segments",
            "2",
            "--top",
            "5",
        ],
        cwd=BENCH,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "copy" in proc.stdout and "elementwise" in proc.stdout, proc.stdout[-2000:]


def test_cut_prompt_backward_estimate_recovers_a_whole_measured_one():
    """bench/pb_summary.py's estimate for a step the device command's timeout cut during its prompt backward (the
    27B's full step at 512K, `full_model_qwen3.6-27b_h100_P524288_offload_full-partial.json`): applied to the whole
    262K step of `full_model_qwen3.6-27b_h100_P262144_offload.json` cut after its first 16 timed
    segments, it gives the measured total within 1%, and its floors are the ones the run itself reported."""
    sys.path.insert(0, str(BENCH))
    try:
        from pb_summary import estimate_cut_prompt_backward
    finally:
        sys.path.remove(str(BENCH))
    data = json.loads((BENCH / "results" / "full_model_qwen3.6-27b_h100_P262144_offload.json").read_text())
    whole = data["longstraw"][1]
    assert whole["gradient_mode"] == "full" and len(whole["segment_s"]) == 32
    starts = list(range(0, whole["prompt_tokens"] - 1, data["capture_chunk_size"]))[::-1]
    cut = {
        **whole,
        "status": "running",
        "partial": {"segment_s": whole["segment_s"][:16], "segment_start_tokens": starts[:16]},
    }
    estimate = estimate_cut_prompt_backward(data, cut)
    assert estimate["segments_timed"] == 16 and estimate["segments_estimated"] == 16
    assert estimate["prompt_backward_estimate_s"] == pytest.approx(sum(whole["segment_s"]), rel=0.01)
    pb = whole["phases"]["prompt_backward"]
    assert estimate["floor_s"] == pytest.approx(pb["floor_s"], rel=1e-9)
    assert estimate["floor_at_kernel_rates_s"] == pytest.approx(pb["floor_at_kernel_rates_s"], rel=1e-9)


def _load_bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_full_model_suite_runs_the_reference_step(monkeypatch, capsys):
    """`bench/run.py full-model` with the host-state options runs full_model.py with the options of the committed
    262K reference step (both gradient modes, state on the host, 8K chunks, R = 32): equal once parsed, but for the
    JSON's name, which the suite derives from the GPU, P and the offload."""
    run = _load_bench("run")
    monkeypatch.setattr(run, "gpu_token", lambda: "h100")
    extra = ["--offload", "cpu", "--chunk", "8192", "--response", "32", "--budget-s", "540"]
    assert run.main(["full-model", "--dry-run", *extra]) == 0
    ours = shlex.split(capsys.readouterr().out.splitlines()[0].split(" full_model.py ", 1)[1].rstrip(")"))
    reference = BENCH / "results" / "full_model_qwen3.6-27b_h100_P262144_offload.json"
    theirs = json.loads(reference.read_text())["command"].split(" full_model.py ", 1)[1].split()
    monkeypatch.syspath_prepend(str(BENCH))
    import full_model

    def parsed(args):
        monkeypatch.setattr(sys, "argv", ["full_model.py", *args])
        return vars(full_model.parse_args())

    got, want = parsed(ours), parsed(theirs)
    assert got.pop("tag") == "_h100_P262144_offload" and want.pop("tag")
    assert got == want
    assert (
        got["prompts"] == [262144]
        and got["gradient_modes"] == ["response_only", "full"]
        and got["offload"] == "cpu"
    )


def test_full_model_suite_names_a_library_defaults_step(monkeypatch, capsys):
    run = _load_bench("run")
    monkeypatch.setattr(run, "gpu_token", lambda: "h100")
    assert run.main(["full-model", "--dry-run", "--library-defaults", "--prompts", "1048576"]) == 0
    argv = shlex.split(capsys.readouterr().out.splitlines()[0].split(" full_model.py ", 1)[1].rstrip(")"))
    assert "--library-defaults" in argv and argv[argv.index("--tag") + 1] == "_h100_P1048576_defaults"


def test_every_suite_builds_its_commands(capsys):
    """Each suite names what it measures and builds commands of scripts that exist."""
    run = _load_bench("run")
    assert 1 < len(run.SUITES) <= 11
    for name, suite in run.SUITES.items():
        assert suite.help and run.main([name, "--dry-run"]) == 0
        for line in capsys.readouterr().out.splitlines():
            script = next((w for w in shlex.split(line.split(" timeout ", 1)[1]) if w.endswith(".py")), None)
            assert script is None or (BENCH / script).is_file() or (BENCH.parent / script).is_file(), (
                name,
                line,
            )


def test_results_index_is_current(tmp_path, monkeypatch):
    """bench/results/README.md is what bench/index.py writes from the result files; the check fails on a stale one."""
    index = _load_bench("index")
    assert index.main(["--check"]) == 0
    stale = tmp_path / "README.md"
    stale.write_text(index.INDEX.read_text().replace("| full_model |", "| full-model |", 1))
    monkeypatch.setattr(index, "INDEX", stale)
    assert index.main(["--check"]) == 1


def test_result_file_names_carry_suite_model_gpu_and_prompt():
    """Every result file is named <suite>_<model>_<gpu>_P<prompt>[_variant] (a CPU run or a plot may leave out P)."""
    index = _load_bench("index")
    for path in (BENCH / "results").iterdir():
        if path.name == "README.md":
            continue
        f = index.parse_name(path.name)
        assert f["suite"] and f["gpu"], path.name
        assert f["P"] or f["gpu"] == "cpu" or path.suffix == ".png" or f["variant"] == "gloo-check", path.name


def test_full_model_suite_runs_a_baseline_checkout_first(tmp_path, capsys):
    """`full-model --baseline DIR`: the same step from the checkout DIR first, DIR first on PYTHONPATH and its files
    in $OUT/baseline with the given revision; then this checkout's step; links let DIR import its subpackages."""
    run = _load_bench("run")
    for sub in ("longstraw_trl", "kernels", "model_patches", "bench"):
        (tmp_path / sub).mkdir()
    opts = run.parse(["full-model", "--baseline", str(tmp_path), "--baseline-rev", "abc1234"])[1]
    steps = run.SUITES["full-model"].build(opts, ["--prompts", "2048"])
    base, ours = steps[0], steps[1]
    assert base.argv == ours.argv and base.cwd == str(tmp_path / "bench") and ours.cwd == "bench"
    assert base.path == (str(tmp_path),) and ours.path == ()
    assert base.env["OUT"].endswith("/baseline") and base.env["LONGSTRAW_REV"] == "abc1234"
    assert (tmp_path / "longstraw_trl" / "kernels").resolve() == (tmp_path / "kernels").resolve()
    assert (tmp_path / "longstraw_trl" / "model_patches").resolve() == (tmp_path / "model_patches").resolve()
    assert run.main(["full-model", "--dry-run", "--baseline", str(tmp_path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"(cd {tmp_path}/bench && PYTHONPATH={tmp_path}:/tmp/site:/tmp/fla ")
    # a flag asking for what older revisions always did is dropped where the baseline's script lacks it
    steps = run.SUITES["full-model"].build(opts, ["--offload", "cpu", "--stream-all-layers"])
    assert "--stream-all-layers" in steps[1].argv and "--stream-all-layers" not in steps[0].argv
    (tmp_path / "bench" / "full_model.py").write_text('ap.add_argument("--stream-all-layers")')
    steps = run.SUITES["full-model"].build(opts, ["--offload", "cpu", "--stream-all-layers"])
    assert steps[0].argv == steps[1].argv


def test_full_model_suite_alternates_pairs_and_gives_the_baseline_its_own_arguments(tmp_path, monkeypatch):
    """`--pairs 3`: base, ours, ours, base, base, ours, each run's files apart; `--baseline-args` reach the baseline
    only (this checkout against itself streaming every layer)."""
    run = _load_bench("run")
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    for sub in ("longstraw_trl", "kernels", "model_patches", "bench"):
        (tmp_path / sub).mkdir()
    argv = ["full-model", "--baseline", str(tmp_path), "--pairs", "3", "--baseline-args=--stream-all-layers"]
    steps = run.SUITES["full-model"].build(run.parse(argv)[1], ["--offload", "cpu"])[
        :-1
    ]  # the last summarises
    assert ["base" if s.path else "ours" for s in steps] == ["base", "ours", "ours", "base", "base", "ours"]
    out = tmp_path / "out"
    assert [s.env["OUT"] for s in steps] == [f"{out}/baseline/0", f"{out}/run0", f"{out}/run1", f"{out}/baseline/1",
                                             f"{out}/baseline/2", f"{out}/run2"]  # fmt: skip
    assert all(s.argv[-1] == "--stream-all-layers" for s in steps if s.path)
    assert not any("--stream-all-layers" in s.argv for s in steps if not s.path)
    assert len({s.log for s in steps}) == 6
    with pytest.raises(SystemExit):
        run.SUITES["full-model"].build(run.parse([*argv[:3], "--pairs", "0"])[1], [])
