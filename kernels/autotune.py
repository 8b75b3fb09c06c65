"""Triton autotuning that a new process does not repeat.

A cold first step of the whole Qwen3.6-27B spent 88 of its 105 s in Triton's autotuner (108 configurations of 8
kernels timed; ``bench/results/cold_start_qwen3.6-27b.json``). ``cache_results`` (Triton >= 3.4) keeps each choice in
Triton's cache directory beside the compiled kernels, so a process that finds that directory again skips both; the
trainer points the directory at the run's output (``LongStrawGRPOConfig.kernel_cache_dir``).
"""

from __future__ import annotations

import inspect
import os


def autotune(triton, configs: list, key: list[str]):
    """``triton.autotune(configs=configs, key=key)`` with its results cached on disk where Triton supports it."""
    kwargs = (
        {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    )
    return triton.autotune(configs=configs, key=key, **kwargs)


KERNEL_CACHE_ENV = "TRITON_CACHE_DIR"
_SET_HERE: list[str] = []  # the value this module last gave TRITON_CACHE_DIR (a later trainer may move it)


def use_kernel_cache(directory: str | None) -> str | None:
    """Point Triton's cache (compiled kernels and, through :func:`autotune` and fla, autotuning results) at
    ``directory`` unless the user set ``TRITON_CACHE_DIR``; ``None`` leaves Triton's default (``~/.triton/cache``).
    Returns the directory in use (``None``: Triton's default). Triton reads the variable at each compilation."""
    current = os.environ.get(KERNEL_CACHE_ENV)
    if current and current not in _SET_HERE:
        return current  # the user's choice wins
    if directory is None:
        if current:
            del os.environ[KERNEL_CACHE_ENV]
        _SET_HERE.clear()
        return None
    directory = os.path.abspath(os.path.expanduser(directory))
    os.environ[KERNEL_CACHE_ENV] = directory
    _SET_HERE[:] = [directory]
    return directory
