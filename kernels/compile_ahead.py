"""Compile a step's Triton kernels ahead, in parallel, from a manifest recorded on the same GPU.

Once nothing is autotuned (``autotune.py``'s pins), what a cold first step still pays is Triton compiling each kernel
specialisation on its first call, one after another, inside the step (issue 29: ~30 s of the whole Qwen3.6-27B's
512K step on a fresh H200). A *compile manifest* (``compile_manifest/<GPU>.json``) lists the specialisations a step
compiled on that GPU (Triton's own serialised specialisation data, as ``JITFunction.preload`` reads it), in the order
the step first met them. :func:`record_compilations` records one (``bench/cold_start.py`` does, on the device).

:func:`start_compile_ahead` compiles the manifest's entries in worker processes into Triton's cache directory while
the trainer sets up, first-met first. When the step meets a kernel, Triton's ordinary lookup finds the binary on
disk; if a worker is still compiling that very specialisation, the step waits for it rather than compiling it a
second time. Nothing else changes: a specialisation the manifest lacks is compiled as usual, and Triton's cache keys
(source, signature, constants, options, target) decide what is reused, so a stale entry is merely unused. An entry
applies only on the same GPU name and Triton version (fla's only with the same fla version).
``LONGSTRAW_COMPILE_AHEAD=0`` turns it off.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

logger = logging.getLogger(__name__)

MANIFEST_DIR = Path(__file__).parent / "compile_manifest"
SWITCH = "LONGSTRAW_COMPILE_AHEAD"


def _gpu_name() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return re.sub(r"[^0-9A-Za-z]+", "_", torch.cuda.get_device_name()).strip("_")


def _versions() -> dict:
    import triton

    versions = {"triton": triton.__version__}
    try:
        import fla

        versions["fla"] = getattr(fla, "__version__", "?")
    except ImportError:
        pass
    return versions


# ---------------------------------------------------------------------------------------------------------------
# Recording


class CompileRecorder:
    """Records every Triton kernel specialisation compiled in this process (a ``jit_cache_hook``), in order."""

    def __init__(self) -> None:
        self.entries: list[dict] = []
        self._seen: set[str] = set()
        self._previous = None

    def __call__(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002
        data = compile["specialization_data"]
        if data not in self._seen:
            self._seen.add(data)
            self.entries.append({"module": fn.module, "qualname": fn.name, "specialization": data})
        if self._previous is not None:
            return self._previous(
                key=key,
                repr=repr,
                fn=fn,
                compile=compile,
                is_manual_warmup=is_manual_warmup,
                already_compiled=already_compiled,
            )
        return None  # None: Triton compiles as usual

    def dump(self, path: str | os.PathLike) -> int:
        """Write the manifest (this GPU, the versions, the entries); returns how many entries."""
        payload = {"gpu": _gpu_name(), **_versions(), "entries": self.entries}
        Path(path).write_text(json.dumps(payload, indent=1) + "\n")
        return len(self.entries)


def record_compilations() -> CompileRecorder:
    """Start recording the specialisations Triton compiles in this process (chained after any existing hook)."""
    from triton import knobs

    recorder = CompileRecorder()
    recorder._previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = recorder
    return recorder
