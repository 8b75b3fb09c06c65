"""`LongStrawGRPOConfig` is plain data: building one imports nothing of the runtime and starts no process; each of
its refusals fires (with a message saying what to change), and its normalisations hold."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from longstraw_trl.config import LongStrawGRPOConfig
from longstraw_trl.constants import KERNEL_CACHE_SUBDIR, GradientMode
from longstraw_trl.errors import LongStrawError

ROOT = Path(__file__).resolve().parents[1]


def _config(tmp_path, **overrides) -> LongStrawGRPOConfig:
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=4,
        num_generations=4,
        report_to="none",
    )
    return LongStrawGRPOConfig(**{**kwargs, **overrides})


# The config's module alone (the package's `__init__` wires the runtime together, so it is stood in for by an empty
# package of the same path): importing it and building a config with `compile_ahead=True` must load no first-party
# module beyond the config's own, and start no process.
_PLAIN_DATA = textwrap.dedent(
    """
    import json, multiprocessing.process, os, subprocess, sys, types

    started = []
    real_popen_init = subprocess.Popen.__init__
    def popen_init(self, *args, **kwargs):
        started.append(repr(args[:1]))
        return real_popen_init(self, *args, **kwargs)
    subprocess.Popen.__init__ = popen_init
    real_start = multiprocessing.process.BaseProcess.start
    def start(self):
        started.append("multiprocessing")
        return real_start(self)
    multiprocessing.process.BaseProcess.start = start
    real_fork = os.fork
    def fork():
        started.append("fork")
        return real_fork()
    os.fork = fork

    package = types.ModuleType("longstraw_trl")
    package.__path__ = [os.path.join(sys.argv[1], "longstraw_trl")]
    sys.modules["longstraw_trl"] = package
    from longstraw_trl.config import LongStrawGRPOConfig

    LongStrawGRPOConfig(
        output_dir=sys.argv[2], use_cpu=True, bf16=False, per_device_train_batch_size=4, num_generations=4,
        report_to="none", compile_ahead=True, kernel_cache_dir="auto", gradient_mode="full",
    )
    loaded = sorted(name for name in sys.modules if name.startswith("longstraw_trl"))
    children = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            children += f.read().split()
    print(json.dumps({"loaded": loaded, "started": started, "children": children}))
    """
)


def test_config_imports_no_runtime_and_starts_no_process(tmp_path):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
    }
    out = subprocess.run(
        [sys.executable, "-c", _PLAIN_DATA, str(ROOT), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(report["loaded"]) <= {
        "longstraw_trl",
        "longstraw_trl.config",
        "longstraw_trl.constants",
        "longstraw_trl.errors",
    }, report["loaded"]
    assert report["started"] == [] and report["children"] == [], report


# Every refusal of `__post_init__`, with a fragment of its message.
REFUSALS = [
    ({"offload_prompt_state": "gpu"}, "offload_prompt_state must be None or 'cpu'"),
    ({"generation_fsdp_gather_gib": -1.0}, "generation_fsdp_gather_gib must be None or >= 0"),
    ({"generation_fsdp_gather_gib": float("nan")}, "generation_fsdp_gather_gib must be None or >= 0"),
    ({"capture_chunk_size": 0}, "capture_chunk_size (or 'auto') and page_size must be positive"),
    ({"page_size": -1}, "capture_chunk_size (or 'auto') and page_size must be positive"),
    ({"capture_chunk_size": "big"}, "capture_chunk_size must be an int or 'auto', got 'big'"),
    ({"replay_batch_tokens": "many"}, "replay_batch_tokens must be an int or 'auto', got 'many'"),
    ({"replay_block_size": 0}, "replay_block_size must be positive or None"),
    ({"replay_batch_tokens": -1}, "replay_batch_tokens must be >= 0"),
    ({"gradient_mode": "prompt"}, "gradient_mode must be one of"),
    ({"gradient_mode": "full", "refresh_policy": "reuse"}, "has no exact full gradient"),
    ({"gradient_mode": "full", "fp16": True}, "gradient_mode='full' with fp16=True is not supported"),
    ({"cp_size": 0}, "cp_size must be >= 1"),
    ({"ep_size": 0}, "ep_size must be >= 1"),
    ({"ep_size": 2, "cp_size": 1}, "ep_size=2 must divide cp_size=1"),
    ({"ep_size": 2, "cp_size": 2, "ep_implementation": "gather"}, "ep_implementation must be one of"),
    ({"cp_size": 2, "scale_rewards": "batch"}, "scale_rewards='batch' with cp_size > 1 is not supported"),
    ({"refresh_policy": "never"}, "refresh_policy must be one of"),
    ({"refresh_interval": -1}, "refresh_interval and refresh_max_interval must be >= 0"),
    ({"refresh_max_interval": -1}, "refresh_interval and refresh_max_interval must be >= 0"),
    ({"refresh_probe_period": 0}, "refresh_probe_period must be >= 1"),
    ({"refresh_drift_threshold": -0.5}, "refresh_drift_threshold must be >= 0"),
    ({"preflight_gpu_memory_bytes": 0}, "preflight_gpu_memory_bytes must be None or > 0 bytes"),
    ({"preflight_gpu_memory_bytes": -(2**30)}, "preflight_gpu_memory_bytes must be None or > 0 bytes"),
]
# Per process: TRL checks the same over all processes, so these are reached only with more than one (two here).
PER_PROCESS_REFUSALS = [
    ({"per_device_train_batch_size": 2}, "every generation batch of a process must hold whole groups"),
    (
        {"do_eval": True, "eval_strategy": "steps", "per_device_eval_batch_size": 2},
        "per_device_eval_batch_size=2 is not a multiple of num_generations=4",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), REFUSALS, ids=[" ".join(map(str, o)) for o, _ in REFUSALS])
def test_config_refuses(tmp_path, overrides, message):
    with pytest.raises(LongStrawError, match=re.escape(message)):
        _config(tmp_path, **overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    PER_PROCESS_REFUSALS,
    ids=[" ".join(map(str, o)) for o, _ in PER_PROCESS_REFUSALS],
)
def test_config_refuses_per_process(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setattr(LongStrawGRPOConfig, "world_size", property(lambda self: 2))
    with pytest.raises(LongStrawError, match=re.escape(message)):
        _config(tmp_path, **overrides)


def test_config_normalises(tmp_path):
    config = _config(tmp_path, offload_prompt_state="none", gradient_mode="response")
    assert config.offload_prompt_state is None
    assert config.gradient_mode is GradientMode.RESPONSE
    assert config.kernel_cache_dir == os.path.join(config.output_dir, KERNEL_CACHE_SUBDIR)
    assert _config(tmp_path, kernel_cache_dir="None").kernel_cache_dir is None
    full = _config(tmp_path, gradient_mode="full")
    assert full.gradient_mode is GradientMode.FULL and full.gradient_mode == "full"
    # serialised as users spell it, and read back
    assert full.to_dict()["gradient_mode"] == "full"
    assert json.loads(full.to_json_string())["gradient_mode"] == "full"
    assert _config(tmp_path, gradient_mode=GradientMode.FULL).gradient_mode is GradientMode.FULL


def test_memory_settings_take_auto_or_a_number(tmp_path):
    """`capture_chunk_size` and `replay_batch_tokens` default to "auto" (the pre-flight plan chooses; the preferred
    value where no plan is made); a number, also as the command line spells it, is kept as an int."""
    from longstraw_trl.options import CaptureOptions, LossOptions, plan_options

    default = _config(tmp_path)
    assert default.capture_chunk_size == "auto" and default.replay_batch_tokens == "auto"
    assert CaptureOptions.from_config(default).capture_chunk_size == 8192
    assert LossOptions.from_config(default).replay_batch_tokens == 8192
    assert (
        plan_options(default)["capture_chunk_size"] == 8192
        and plan_options(default)["replay_batch_tokens"] == 8192
    )
    given = _config(tmp_path, capture_chunk_size="4096", replay_batch_tokens=0)
    assert given.capture_chunk_size == 4096 and given.replay_batch_tokens == 0
    assert _config(tmp_path, capture_chunk_size=" AUTO ").capture_chunk_size == "auto"
    from transformers import HfArgumentParser

    from longstraw_trl import LongStrawGRPOConfig

    (parsed,) = HfArgumentParser(LongStrawGRPOConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--bf16", "false", "--report_to", "none"]
        + ["--per_device_train_batch_size", "4", "--num_generations", "4"]
        + ["--capture_chunk_size", "2048", "--replay_batch_tokens", "auto"]
    )
    assert parsed.capture_chunk_size == 2048 and parsed.replay_batch_tokens == "auto"
