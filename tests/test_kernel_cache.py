"""Triton's kernel cache follows the run (a cold first step of the whole 27B spent 88 of its 105 s
compiling and autotuning; a new process that found the cache again took 8.5 s against 6.2 s warm)."""

from __future__ import annotations

import functools
import inspect
import json
import os

import pytest
from _trl_helpers import make_tiny_longstraw_trainer

from longstraw_trl.constants import KERNEL_CACHE_SUBDIR
from longstraw_trl.kernels.runtime.switches import DISABLE_ENV


def test_kernel_cache_follows_the_output_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    first = make_tiny_longstraw_trainer(output_dir=str(tmp_path / "run"))
    assert first.args.kernel_cache_dir == str(tmp_path / "run" / KERNEL_CACHE_SUBDIR)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "run" / KERNEL_CACHE_SUBDIR)
    make_tiny_longstraw_trainer(output_dir=str(tmp_path / "run2"))  # a later trainer of the process moves it
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "run2" / KERNEL_CACHE_SUBDIR)
    make_tiny_longstraw_trainer(output_dir=str(tmp_path / "run3"), kernel_cache_dir=None)
    assert "TRITON_CACHE_DIR" not in os.environ  # None: Triton's own default
    make_tiny_longstraw_trainer(output_dir=str(tmp_path / "run4"), kernel_cache_dir=str(tmp_path / "kernels"))
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "kernels")


def test_user_triton_cache_dir_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    make_tiny_longstraw_trainer(output_dir=str(tmp_path / "run"))
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")


def test_our_autotuned_kernels_cache_their_choice(monkeypatch):
    """A process on a warm cache times no configuration of ours again (Triton's autotune ``cache_results``)."""
    triton = pytest.importorskip("triton")
    if "cache_results" not in inspect.signature(triton.autotune).parameters:
        pytest.skip(f"Triton {triton.__version__} has no autotune cache_results")
    from longstraw_trl.kernels.attention import prompt_dq
    from longstraw_trl.kernels.sparse_attention import indexer as indexer_scores

    calls = []
    autotune = triton.autotune

    @functools.wraps(autotune)  # keeps its signature, which the wrapper inspects
    def recording_autotune(*args, **kwargs):
        calls.append(kwargs)
        return autotune(*args, **kwargs)

    monkeypatch.setattr(triton, "autotune", recording_autotune)
    for module in (prompt_dq, indexer_scores):
        module._kernel.cache_clear()  # build again under the recording autotune
        try:
            module._kernel()
        finally:
            module._kernel.cache_clear()
    assert len(calls) == 2 and all(kw.get("cache_results") for kw in calls), calls


def _tiny_autotuned_kernel(triton, tl):
    @triton.jit
    def pinned_probe_kernel(X, N: tl.constexpr):
        pass

    configs = [triton.Config({"B": 1}), triton.Config({"B": 2}, num_warps=8), triton.Config({"B": 4})]
    return configs, pinned_probe_kernel


def test_pinned_choices_reach_a_fresh_autotuner(monkeypatch, tmp_path):
    """A choice dumped on one machine is in a new autotuner's cache before its first call: nothing is timed."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    from longstraw_trl.kernels.runtime import autotune as at

    monkeypatch.setattr(at, "gpu_name", lambda: "TEST_GPU")
    monkeypatch.setattr(at, "PINS_DIR", tmp_path)
    monkeypatch.setattr(at, "_OURS", [])
    at._pins.cache_clear()
    configs, kernel = _tiny_autotuned_kernel(triton, tl)
    tuned = at.autotune(triton, configs, key=["N"])(kernel)
    assert not tuned.cache  # no pin file yet
    key = (64, "torch.bfloat16")
    tuned.cache[key] = configs[1]  # what the autotuner would have chosen
    assert at.dump_autotune_choices(tmp_path / "TEST_GPU.json") == 1
    at._pins.cache_clear()
    configs2, kernel2 = _tiny_autotuned_kernel(triton, tl)
    fresh = at.autotune(triton, configs2, key=["N"])(kernel2)
    assert str(fresh.cache[key]) == str(configs[1]) and fresh.cache[key] in configs2
    # pins made with another Triton are ignored
    pins = json.loads((tmp_path / "TEST_GPU.json").read_text())
    (tmp_path / "TEST_GPU.json").write_text(json.dumps({**pins, "triton": "0.0"}))
    at._pins.cache_clear()
    configs3, kernel3 = _tiny_autotuned_kernel(triton, tl)
    assert not at.autotune(triton, configs3, key=["N"])(kernel3).cache
    # and LONGSTRAW_DISABLE=autotune_pins turns pinning off
    (tmp_path / "TEST_GPU.json").write_text(json.dumps(pins))
    at._pins.cache_clear()
    monkeypatch.setenv(DISABLE_ENV, at.PINS_SWITCH)
    configs4, kernel4 = _tiny_autotuned_kernel(triton, tl)
    assert not at.autotune(triton, configs4, key=["N"])(kernel4).cache
    at._pins.cache_clear()
