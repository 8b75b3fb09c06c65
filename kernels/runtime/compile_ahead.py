"""Compile a step's Triton kernels ahead, in parallel, from a manifest recorded on the same GPU.

Once nothing is autotuned (``autotune.py``'s pins), what a cold first step still pays is Triton compiling each kernel
specialisation on its first call, one after another, inside the step (~30 s of the whole Qwen3.6-27B's
512K step on a fresh H200), and building each kernel signature's C launcher with the host compiler on its first
launch. A *compile manifest* (``compile_manifest/<GPU>.json``) lists the specialisations a step
compiled on that GPU (Triton's own serialised specialisation data, as ``JITFunction.preload`` reads it), in the order
the step first met them. :func:`record_compilations` records one (``bench/cold_start.py`` does, on the device).

:func:`start_compile_ahead` compiles the manifest's entries in worker processes into Triton's cache directory while
the trainer sets up, first-met first, with their launchers. When the step meets a kernel, Triton's ordinary lookup
finds the binary on disk; if a worker is still compiling that very specialisation, the step waits for it rather than
compiling it a second time. Nothing else changes: a specialisation the manifest lacks is compiled as usual, and
Triton's cache keys (source, signature, constants, options, target) decide what is reused, so a stale entry is merely
unused. An entry applies only on the same GPU name and Triton version (fla's only with the same fla version).
``LONGSTRAW_DISABLE=compile_ahead`` turns it off.
"""

from __future__ import annotations

import atexit
import importlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .autotune import gpu_name, use_kernel_cache, versions
from .switches import enabled

logger = logging.getLogger(__name__)

MANIFEST_DIR = Path(__file__).parent / "compile_manifest"
SWITCH = "compile_ahead"


def _versions() -> dict:
    return versions(import_fla=True)  # fla is imported by the step later; its kernels' entries depend on it


# ---------------------------------------------------------------------------------------------------------------
# Recording


def _chain(previous, **hook_kwargs):
    """Call the ``jit_cache_hook`` that was installed before ours (its answer decides whether Triton compiles)."""
    return previous(**hook_kwargs) if previous is not None else None


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
        return _chain(self._previous, key=key, repr=repr, fn=fn, compile=compile,
                      is_manual_warmup=is_manual_warmup, already_compiled=already_compiled)  # fmt: skip

    def dump(self, path: str | os.PathLike) -> int:
        """Write the manifest (this GPU, the versions, the entries); returns how many entries."""
        payload = {"gpu": gpu_name(), **_versions(), "entries": self.entries}
        Path(path).write_text(json.dumps(payload, indent=1) + "\n")
        return len(self.entries)


def record_compilations() -> CompileRecorder:
    """Start recording the specialisations Triton compiles in this process (chained after any existing hook)."""
    from triton import knobs

    recorder = CompileRecorder()
    recorder._previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = recorder
    return recorder


# ---------------------------------------------------------------------------------------------------------------
# Compiling ahead


def load_manifest(gpu: str | None = None, directory: Path = MANIFEST_DIR) -> list[dict]:
    """The manifest entries that apply here: this GPU's file, the same Triton version, fla's entries only with the
    same fla version (none where fla is not importable). Empty when nothing applies."""
    gpu = gpu or gpu_name()
    path = directory / f"{gpu}.json" if gpu else None
    if path is None or not path.exists():
        return []
    manifest = json.loads(path.read_text())
    here = _versions()
    if manifest.get("triton") != here["triton"]:
        logger.info("compile manifest %s is for Triton %s, not %s: not used", path.name, manifest.get("triton"),
                    here["triton"])  # fmt: skip
        return []
    same_fla = manifest.get("fla") is not None and manifest.get("fla") == here.get("fla")
    return [e for e in manifest["entries"] if same_fla or not e["module"].startswith("fla")]


def _unwrap_jit(obj):
    """The ``JITFunction`` under ``@triton.autotune`` / ``@triton.heuristics`` wrappers (their ``.fn``), or None."""
    from triton.runtime.jit import JITFunction

    for _ in range(8):
        if isinstance(obj, JITFunction):
            return obj
        obj = getattr(obj, "fn", None)
        if obj is None:
            return None
    return None


def _search_built(obj, qualname: str, depth: int = 0):
    """A JITFunction named ``qualname`` inside what a kernel module's cached builder returned (a kernel, a tuple,
    a namespace)."""
    jit = _unwrap_jit(obj)
    if jit is not None:
        return jit if jit.fn.__qualname__ == qualname else None
    if depth > 2:
        return None
    if isinstance(obj, (tuple, list)):
        children = obj
    elif isinstance(obj, dict):
        children = obj.values()
    elif hasattr(obj, "__dict__") and not isinstance(obj, type) and type(obj).__module__ == "types":
        children = vars(obj).values()
    else:
        return None
    for child in children:
        found = _search_built(child, qualname, depth + 1)
        if found is not None:
            return found
    return None


def find_jit_function(module_name: str, qualname: str):
    """The JITFunction a manifest entry names: a module attribute (through its autotune / heuristics wrappers), or,
    for a kernel defined inside a cached builder (``_kernel.<locals>.dq_kernel``), what that builder returns."""
    module = importlib.import_module(module_name)
    head, *rest = qualname.split(".")
    obj = getattr(module, head, None)
    if obj is None:
        return None
    if rest and rest[0] == "<locals>":
        return _search_built(obj(), qualname)
    jit = _unwrap_jit(obj)
    return jit if jit is not None and jit.fn.__qualname__ == qualname else None


def build_launcher(kernel) -> None:
    """Build a compiled kernel's host launcher into Triton's cache. Triton builds one C launcher per kernel signature
    with the host's C compiler on the kernel's first launch (``CudaLauncher``: about 0.3-1.4 s each, the larger part
    of a cold step's first capture chunk on the device), cached beside the binaries by its source; building it here
    makes the step's first launch load it from disk. Needs no GPU context."""
    from triton.runtime import driver

    driver.active.launcher_cls(kernel.src, kernel.metadata)


def _worker(manifest_path: str, indices: list[int]) -> None:
    """A compile worker: compile the given entries (Triton's ``JITFunction.preload``: the same source, signature,
    constants and options, so the same cache key as the step's own call) and build their launchers
    (:func:`build_launcher`), print ``done i`` or ``failed i why``."""
    entries = json.loads(Path(manifest_path).read_text())
    for i in indices:
        entry = entries[i]
        try:
            jit = find_jit_function(entry["module"], entry["qualname"])
            if jit is None:
                raise LookupError(f"no kernel {entry['module']}.{entry['qualname']}")
            kernel = jit.preload(entry["specialization"])
            if kernel is not None:
                build_launcher(kernel)
            print(f"done {i}", flush=True)
        except Exception as exc:  # noqa: BLE001 - one entry's failure leaves the step to compile it itself
            print(f"failed {i} {type(exc).__name__}: {str(exc)[:200]}".replace("\n", " "), flush=True)


class CompileAhead:
    """Worker processes compiling a manifest's entries into Triton's cache directory (the environment's
    ``TRITON_CACHE_DIR``, inherited), and a ``jit_cache_hook`` that makes this process wait for an entry a worker is
    still compiling instead of compiling it again. :meth:`stats` says what it did."""

    def __init__(self, entries: list[dict], workers: int, wait_s: float = 30.0) -> None:
        from triton import knobs

        self.started = time.perf_counter()
        self.entries = entries
        self.wait_s = wait_s
        self.index = {e["specialization"]: i for i, e in enumerate(entries)}
        self.done = [threading.Event() for _ in entries]
        self.outcome: dict[int, str] = {}
        self.waited_s = 0.0
        self.waits = 0
        self.gave_up = False
        self._lock = threading.Lock()
        self._unsettled = len(entries)
        self.finished_s: float | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="longstraw_compile_ahead_")
        manifest = Path(self._dir.name) / "entries.json"
        manifest.write_text(json.dumps(entries))
        workers = max(1, min(workers, len(entries)))
        self.procs = []
        for w in range(workers):
            # round robin: each worker takes its entries first-met first, as the step will meet them
            indices = list(range(w, len(entries), workers))
            cmd = [sys.executable, "-m", __name__, manifest, ",".join(map(str, indices))]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self.procs.append(proc)
            threading.Thread(target=self._read, args=(proc, indices), daemon=True).start()
        self._previous = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._hook
        atexit.register(self.close)  # a process that ends first takes its workers with it

    def close(self) -> None:
        """Stop the workers still running (their finished binaries stay in the cache)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()

    def _read(self, proc, indices: list[int]) -> None:
        for line in proc.stdout:
            word, _, rest = line.strip().partition(" ")
            number, _, why = rest.partition(" ")
            if word in ("done", "failed") and number.isdigit():
                i = int(number)
                self.outcome[i] = "done" if word == "done" else f"failed: {why}"
                self._settle(i)
        proc.wait()
        for i in indices:  # a worker that died leaves its remaining entries to the step
            if not self.done[i].is_set():
                self.outcome.setdefault(i, f"worker exited {proc.returncode}")
                self._settle(i)

    def _settle(self, i: int) -> None:
        with self._lock:
            self.done[i].set()
            self._unsettled -= 1
            if self._unsettled == 0:
                self.finished_s = round(time.perf_counter() - self.started, 3)

    def _hook(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002
        i = self.index.get(compile["specialization_data"])
        if i is not None and not self.done[i].is_set() and not self.gave_up:
            t = time.perf_counter()
            if not self.done[i].wait(self.wait_s):
                self.gave_up = True  # a stuck worker: compile here from now on, never wait again
            self.waited_s += time.perf_counter() - t
            self.waits += 1
        # then Triton finds the worker's binary in its cache directory (or compiles it itself)
        return _chain(self._previous, key=key, repr=repr, fn=fn, compile=compile,
                      is_manual_warmup=is_manual_warmup, already_compiled=already_compiled)  # fmt: skip

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every entry is compiled or given up; whether all are."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        for event in self.done:
            left = None if deadline is None else max(0.0, deadline - time.perf_counter())
            if not event.wait(left):
                return False
        return True

    def stats(self) -> dict:
        failed = {i: why for i, why in self.outcome.items() if why != "done"}
        return {
            "entries": len(self.entries),
            "workers": len(self.procs),
            "compiled_ahead": sum(1 for why in self.outcome.values() if why == "done"),
            "failed": len(failed),
            "first_failures": [
                f"{self.entries[i]['qualname']}: {why}" for i, why in sorted(failed.items())[:3]
            ],
            "finished_s": self.finished_s,
            "step_waited_s": round(self.waited_s, 3),
            "step_waits": self.waits,
            "gave_up_waiting": self.gave_up,
        }


_ACTIVE: list[CompileAhead] = []


def start_compile_ahead(workers: int | None = None) -> CompileAhead | None:
    """Start compiling this GPU's manifest (:func:`load_manifest`) in worker processes, once per process; ``None``
    where nothing applies (no CUDA, no Triton, no manifest for this GPU and these versions, or
    ``LONGSTRAW_DISABLE=compile_ahead``). Call it after Triton's cache directory is set (the workers inherit it)."""
    if _ACTIVE:
        return _ACTIVE[0]
    if not enabled(SWITCH):
        return None
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    entries = load_manifest()
    if not entries:
        return None
    workers = workers or max(1, min(8, (os.cpu_count() or 2) // 2))
    ahead = CompileAhead(entries, workers)
    _ACTIVE.append(ahead)
    logger.info("compiling %d Triton kernel specialisations ahead in %d processes (kernels/runtime/compile_ahead.py)",
                len(entries), ahead.stats()["workers"])  # fmt: skip
    return ahead


def start_compile_ahead_here(kernel_cache_dir: str | None) -> CompileAhead | None:
    """:func:`start_compile_ahead` where it belongs: with CUDA, in the first process of a machine only (its
    workers use the first visible GPU; the other ranks find the binaries in the shared cache directory), after
    pointing Triton's cache at ``kernel_cache_dir`` (``autotune.use_kernel_cache``)."""
    import torch

    if not torch.cuda.is_available() or int(os.environ.get("LOCAL_RANK", "0") or 0) != 0:
        return None
    use_kernel_cache(kernel_cache_dir)
    return start_compile_ahead()


def active_compile_ahead() -> CompileAhead | None:
    """The compile-ahead this process started, if any (for its stats)."""
    return _ACTIVE[0] if _ACTIVE else None


if __name__ == "__main__":
    _worker(sys.argv[1], [int(i) for i in sys.argv[2].split(",") if i])
