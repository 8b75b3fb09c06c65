"""Triton autotuning that neither a new process nor a fresh machine repeats.

A cold first step of the whole Qwen3.6-27B spent 88 of its 105 s in Triton's autotuner (108 configurations of 8
kernels, 7 of them fla's GDN forward, timed; ``bench/results/cold_start_qwen3.6-27b_h200_P32768.json``). Two remedies:

* ``cache_results`` (Triton >= 3.4; fla sets it too): each choice is kept in Triton's cache directory beside the
  compiled kernels, so a process that finds that directory again skips both. The trainer points the directory at
  the run's output (``LongStrawGRPOConfig.kernel_cache_dir``, :func:`use_kernel_cache`).
* Pinned choices: ``autotune_pins/<GPU>.json`` holds the configurations the autotuner chose on that GPU (measured by
  ``bench/cold_start.py``, for one Triton and one fla version). :func:`pin_autotune_choices` puts them in each
  autotuner's cache before its first call, so a fresh machine compiles one configuration per kernel and times
  none. A pin applies only to the same GPU, Triton version, kernel, key and an identical configuration among the
  kernel's own; anything else is tuned as usual. ``LONGSTRAW_DISABLE=autotune_pins`` turns pinning off.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import re
import sys
from pathlib import Path

from .switches import enabled

logger = logging.getLogger(__name__)

PINS_DIR = Path(__file__).parent / "autotune_pins"
PINS_SWITCH = "autotune_pins"
_OURS: list = []  # the autotuners :func:`autotune` made (they live inside cached builders, not module attributes)


def autotune(triton, configs: list, key: list[str]):
    """``triton.autotune(configs=configs, key=key)`` with its results cached on disk where Triton supports it,
    and this GPU's pinned choices applied (:func:`pin_autotune_choices`)."""
    kwargs = (
        {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    )
    make = triton.autotune(configs=configs, key=key, **kwargs)

    def decorate(fn):
        tuner = make(fn)
        _OURS.append(tuner)
        pin_autotune_choices([tuner])
        return tuner

    return decorate


def kernel_name(tuner) -> str:
    """``module.function`` of an autotuned kernel (what a pin file names)."""
    fn = tuner.base_fn
    return f"{fn.__module__}.{fn.__name__}"


def loaded_autotuners() -> list:
    """Every Triton autotuner in a loaded fla module, and ours."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return []
    found = {id(t): t for t in _OURS}
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for value in list(vars(module).values()):
            while value is not None and not isinstance(value, Autotuner) and hasattr(value, "fn"):
                value = value.fn  # through @triton.heuristics and the like
            if isinstance(value, Autotuner):
                found.setdefault(id(value), value)
    return list(found.values())


def gpu_name() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return re.sub(r"[^0-9A-Za-z]+", "_", torch.cuda.get_device_name()).strip("_")


def versions(import_fla: bool = False) -> dict:
    """Triton's version, and fla's where it is loaded (``import_fla``: where it is importable)."""
    import triton

    versions = {"triton": triton.__version__}
    fla = sys.modules.get("fla")
    if fla is None and import_fla:
        try:
            import fla
        except ImportError:
            fla = None
    if fla is not None:
        versions["fla"] = getattr(fla, "__version__", "?")
    return versions


def dump_autotune_choices(path: str | os.PathLike) -> int:
    """Write the choices every loaded autotuner has made so far (a pin file for this GPU); returns how many."""
    kernels = {}
    for tuner in loaded_autotuners():
        if tuner.cache:
            entries = [{"key": list(k), "config": str(c)} for k, c in tuner.cache.items()]
            kernels.setdefault(kernel_name(tuner), []).extend(entries)
    payload = {"gpu": gpu_name(), **versions(), "kernels": kernels}
    Path(path).write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    return sum(len(v) for v in kernels.values())


@functools.cache
def _pins(gpu: str) -> dict:
    path = PINS_DIR / f"{gpu}.json"
    if not path.exists():
        return {}
    pins = json.loads(path.read_text())
    if pins.get("triton") != versions()["triton"]:
        logger.info("autotune pins %s are for Triton %s, not %s: not used", path.name, pins.get("triton"),
                    versions()["triton"])  # fmt: skip
        return {}
    return pins


def pin_autotune_choices(tuners: list | None = None) -> int:
    """Put this GPU's pinned choices into the autotuners' caches (all loaded ones by default); returns how many."""
    if not enabled(PINS_SWITCH):
        return 0
    gpu = gpu_name()
    pins = _pins(gpu) if gpu else {}
    if not pins:
        return 0
    fla_version = versions().get("fla")
    pinned = 0
    for tuner in loaded_autotuners() if tuners is None else tuners:
        name = kernel_name(tuner)
        if name.startswith("fla.") and pins.get("fla") != fla_version:
            continue
        by_text = {str(c): c for c in tuner.configs}
        for entry in pins["kernels"].get(name, []):
            config = by_text.get(entry["config"])
            key = tuple(entry["key"])
            if config is not None and key not in tuner.cache:
                tuner.cache[key] = config
                pinned += 1
    return pinned


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
