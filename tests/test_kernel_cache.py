"""Triton's kernel cache follows the run (issue 29: a cold first step of the whole 27B spent 88 of its 105 s
compiling and autotuning; a new process that found the cache again took 8.5 s against 6.2 s warm)."""

from __future__ import annotations

import functools
import inspect
import os

import pytest
from _trl_helpers import make_tiny_longstraw_trainer

from longstraw_trl.config import KERNEL_CACHE_SUBDIR


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
    from longstraw_trl.kernels import indexer_scores, prompt_dq

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
