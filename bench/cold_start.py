"""What a cold first step pays: the whole Qwen3.6-27B's ``train()`` step in fresh processes.

Runs ``full_model.py`` (LoRA, ``LongStrawGRPOTrainer.train()``, no warm-up step) twice as new processes, each doing
the same step twice (``--prompts P P``):

- ``cold``: an empty Triton cache directory, as on a fresh machine or container: the first step compiles every
  Triton kernel (ours and fla's) and autotunes them; the second step in the same process is warm;
- ``disk cache``: a new process on the same cache directory (what a persistent ``TRITON_CACHE_DIR`` /
  ``~/.triton`` gives a restarted job): compiled kernels and autotune results (fla caches them, ``cache_results``)
  are read from disk; what it still pays is process-level (CUDA context, cuBLAS / cuDNN plans, Python imports).

With ``--pins``: a ``tune`` process (one step at ``--tune-prompt`` on an empty cache) writes the choices Triton's
autotuner made as this GPU's pin file (``kernels/runtime/autotune_pins/<GPU>.json``, see kernels/runtime/autotune.py), then a
``pinned`` process on another empty cache, as a fresh machine with the pins installed, takes two steps at
``--prompt``: its first against its second is what a cold start costs with the pins.

Each child counts, through Triton's autotuner, the configurations it benchmarked and the seconds spent there
(compiling and timing them), and the kernels compiled into the cache directory. A short table last; the JSON
(``cold_start_<preset>.json``) has each child's full_model.py result.

    python bench/cold_start.py --prompt 32768
    python bench/cold_start.py --pins --prompt 524288   # measure this GPU's autotune pins, then a pinned cold step
    python bench/cold_start.py --tiny     # CPU dry run of the orchestration (tests/test_bench_scripts.py)
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import print_table, write_result

HERE = Path(__file__).parent
PINS_DIR = HERE.parent / "kernels" / "runtime" / "autotune_pins"
MANIFEST_DIR = HERE.parent / "kernels" / "runtime" / "compile_manifest"
STATS_PREFIX = "COLD_START_STATS "


def _count_compiled(cache_dir: Path) -> int:
    """Kernels compiled into a Triton cache directory (one folder per kernel binary, holding its ``.json``)."""
    if not cache_dir.exists():
        return 0
    return sum(1 for d in cache_dir.iterdir() if d.is_dir() and any(d.glob("*.json")))


def _listen_to_compilations(stats: dict) -> None:
    """Count what Triton compiles in this process, by kernel: binaries built, specialisations of each kernel
    (distinct source hashes), seconds in the compiler (its own timer), and cache hits, into ``stats``. What is
    left of a cold step once nothing is tuned is mostly this, so it says which kernels to compile ahead or
    specialise less."""
    try:
        from triton import knobs
    except ImportError:
        return
    if not hasattr(knobs.compilation, "listener"):
        return
    by_kernel: dict = {}
    stats["compile_s"] = 0.0
    stats["compiled_by_kernel"] = by_kernel
    t_start = time.perf_counter()

    def listener(*, src, metadata, metadata_group, times, cache_hit) -> None:
        name = metadata.get("name") or getattr(src, "name", "?")
        entry = by_kernel.setdefault(
            name, {"compiled": 0, "cache_hits": 0, "compile_s": 0.0, "first_at_s": None}
        )
        if entry["first_at_s"] is None:
            entry["first_at_s"] = round(time.perf_counter() - t_start, 1)
        if cache_hit:
            entry["cache_hits"] += 1
            return
        seconds = times.total / 1e6
        entry["compiled"] += 1
        entry["compile_s"] = round(entry["compile_s"] + seconds, 3)
        stats["compile_s"] += seconds

    knobs.compilation.listener = listener


def _timed(fn, stats: dict, count: str, seconds: str, each=None):
    """``fn``, each call counted in ``stats[count]`` and its seconds added to ``stats[seconds]``; ``each(*args)``
    after every call (the call's own arguments)."""

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            stats[seconds] += time.perf_counter() - t
            stats[count] += 1
            if each is not None:
                each(*args)

    return timed


def _time_host_builds(stats: dict) -> None:
    """Count and time what Triton builds with the host's C compiler (``triton.runtime.build._build``: each kernel
    signature's launcher, and Triton's own driver utilities once per cache directory)."""
    try:
        import triton.runtime.build as triton_build
    except ImportError:
        return
    stats["host_builds"] = 0
    stats["host_build_s"] = 0.0
    triton_build._build = _timed(triton_build._build, stats, "host_builds", "host_build_s")


class StepStackSampler:
    """Where the main thread's time goes, step by step: samples its Python stack every ``interval`` seconds from a
    daemon thread and counts each sample under the step it falls in (the n-th ``LongStrawGRPOTrainer.train()``
    call) and its innermost ``depth`` frames. A first-call cost outside Triton (a library loading, a plan being
    built, a runtime compilation) sits in one C call, so the Python frame that made the call names it; the first
    step's seconds beside the second's say what being first cost."""

    def __init__(self, interval: float = 0.02, depth: int = 3) -> None:
        self.interval, self.depth = interval, depth
        self.step = 0  # 0: outside any train(); n: inside the n-th
        self.steps_started = 0
        self.samples: dict[int, dict[str, int]] = {}
        self._stop = threading.Event()
        self._main = threading.main_thread().ident

    def wrap_train(self, cls) -> None:
        train = cls.train
        sampler = self

        def train_marked(trainer, *args, **kwargs):
            sampler.steps_started += 1
            sampler.step = sampler.steps_started
            try:
                return train(trainer, *args, **kwargs)
            finally:
                sampler.step = 0

        cls.train = train_marked

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self._main)
            parts = []
            while frame is not None and len(parts) < self.depth:
                code = frame.f_code
                parts.append(f"{Path(code.co_filename).name}:{code.co_name}:{frame.f_lineno}")
                frame = frame.f_back
            key = " < ".join(parts)
            counts = self.samples.setdefault(self.step, {})
            counts[key] = counts.get(key, 0) + 1

    def first_over_second(self, top: int = 25) -> list[dict]:
        """The stacks whose seconds in step 1 most exceed step 2's."""
        first, second = self.samples.get(1, {}), self.samples.get(2, {})
        rows = [
            {
                "stack": key,
                "step1_s": round(first.get(key, 0) * self.interval, 2),
                "step2_s": round(second.get(key, 0) * self.interval, 2),
            }
            for key in set(first) | set(second)
        ]
        rows.sort(key=lambda r: r["step2_s"] - r["step1_s"])
        return rows[:top]


def child(argv: list[str], dump_pins: str | None) -> None:
    """Run full_model.py in this process with Triton's autotuner instrumented; print the counts last, and with
    ``dump_pins`` write the autotuners' choices as this GPU's pin file (kernels/runtime/autotune.py)."""
    stats = {"autotune_configs_benchmarked": 0, "autotune_s": 0.0, "autotuned_kernels": []}
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:  # CPU machine without Triton: nothing to count
        Autotuner = None
    if Autotuner is not None:

        def note_kernel(tuner, *args) -> None:
            name = getattr(getattr(tuner, "fn", None), "__name__", "?")
            if name not in stats["autotuned_kernels"]:
                stats["autotuned_kernels"].append(name)

        Autotuner._bench = _timed(
            Autotuner._bench, stats, "autotune_configs_benchmarked", "autotune_s", note_kernel
        )
    _listen_to_compilations(stats)
    _time_host_builds(stats)
    sampler = StepStackSampler()
    try:
        from longstraw_trl import LongStrawGRPOTrainer

        sampler.wrap_train(LongStrawGRPOTrainer)
        sampler.start()
    except ImportError:  # the orchestration's own dry run without the library: no sampling
        sampler = None
    recorder = None
    if dump_pins:  # the pinned process: also the specialisations it compiled (runtime/compile_ahead.py)
        try:
            from longstraw_trl.kernels.runtime.compile_ahead import record_compilations

            recorder = record_compilations()
        except ImportError:  # no Triton: nothing compiles
            pass
    t0 = time.perf_counter()
    sys.argv = [str(HERE / "full_model.py"), *argv]
    try:
        runpy.run_path(str(HERE / "full_model.py"), run_name="__main__")
    finally:
        stats["process_s"] = time.perf_counter() - t0
        if "host_build_s" in stats:
            stats["host_build_s"] = round(stats["host_build_s"], 3)
        if sampler is not None:
            sampler.stop()
            stats["first_step_extra_by_stack"] = sampler.first_over_second()
        try:
            from longstraw_trl.kernels.runtime.compile_ahead import active_compile_ahead

            ahead = active_compile_ahead()
            if ahead is not None:
                ahead.wait(60)
                stats["compile_ahead"] = ahead.stats()
        except ImportError:
            pass
        if dump_pins:
            from longstraw_trl.kernels.runtime.autotune import dump_autotune_choices

            stats["pins_written"] = dump_autotune_choices(dump_pins)
            if recorder is not None:
                manifest = Path(dump_pins).with_name(Path(dump_pins).stem + "_compile_manifest.json")
                stats["compile_manifest_entries"] = recorder.dump(manifest)
        print(STATS_PREFIX + json.dumps(stats), flush=True)


def run_case(
    name: str,
    cache_dir: Path,
    args,
    out_dir: Path,
    prompts: list[int],
    dump_pins: Path | None = None,
    extra: tuple[str, ...] = (),
) -> dict:
    """One fresh process of full_model.py on ``cache_dir``: its step results and the child's counts."""
    before = _count_compiled(cache_dir)
    tag = f"_cold_start_{name.replace(' ', '_')}"
    cmd = [sys.executable, "-u", __file__, "--child", *(["--dump-pins", str(dump_pins)] if dump_pins else [])]
    cmd += ["--", "--skip-stock", "--warmup-prompt", "0", "--tag", tag]
    cmd += ["--prompts", *map(str, prompts), "--response", str(args.response)]
    cmd += ["--generations", str(args.generations), "--budget-s", str(args.budget_s)]
    if args.tiny:
        cmd.append("--tiny")
    cmd += extra
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache_dir), "OUT": str(out_dir)}
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=HERE)
    wall = time.perf_counter() - t
    lines = proc.stdout.splitlines()
    stats = next((json.loads(x[len(STATS_PREFIX) :]) for x in lines if x.startswith(STATS_PREFIX)), {})
    result_file = out_dir / f"full_model_{args.preset}{'_tiny' if args.tiny else ''}{tag}.json"
    result = json.loads(result_file.read_text()) if result_file.exists() else {}
    if proc.returncode != 0 or not result:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", flush=True)
    return {
        "case": name,
        "returncode": proc.returncode,
        "wall_s": wall,
        "kernels_compiled": _count_compiled(cache_dir) - before,
        **stats,
        "steps": result.get("longstraw", []),
    }


def _phase(step: dict, name: str) -> str:
    seconds = step.get("phases", {}).get(name, {}).get("seconds")
    return "-" if seconds is None else f"{seconds:.1f}"


def main() -> None:
    if "--child" in sys.argv:
        pins = sys.argv[sys.argv.index("--dump-pins") + 1] if "--dump-pins" in sys.argv else None
        child(sys.argv[sys.argv.index("--") + 1 :], pins)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3.6-27b")
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=260.0, help="each child's full_model.py budget")
    ap.add_argument(
        "--pins",
        action="store_true",
        help="instead: a 'tune' process at --tune-prompt writes this GPU's autotune pins into kernels/runtime/autotune_pins/ "
        "(and $OUT), then a 'pinned' process on another empty cache takes two steps at --prompt",
    )
    ap.add_argument(
        "--tune-prompt",
        type=int,
        default=32768,
        help="two capture chunks at least: the second meets the kernels' keys with an initial (conv / GDN) state",
    )
    ap.add_argument(
        "--tune-layers",
        type=int,
        default=4,
        help="the tune process's model slice (full_model.py --layers): every layer of a kind runs the same kernels "
        "at the same keys, so a slice holding each kind meets them all, in a fraction of the whole model's time",
    )
    ap.add_argument(
        "--skip-tune",
        action="store_true",
        help="with --pins: no 'tune' process; the 'pinned' process uses the pins already in kernels/runtime/autotune_pins/",
    )
    ap.add_argument(
        "--offload",
        choices=["cpu"],
        default=None,
        help="the measured steps' offload_prompt_state (full_model.py --offload): 512K on an 80 GB GPU",
    )
    ap.add_argument("--tiny", action="store_true", help="CPU dry run (full_model.py --tiny)")
    args = ap.parse_args()
    if args.tiny:
        args.prompt, args.tune_prompt, args.response, args.generations = 512, 512, 4, 2
    payload = {
        "model": f"{args.preset}, whole model, random init, LoRA (full_model.py), one train() step twice per process",
        "prompt_tokens": args.prompt,
        "response_tokens": args.response,
        "generations": args.generations,
        "cases": [],
    }
    measured = ("--offload", args.offload) if args.offload else ()  # the measured steps' own options
    payload["offload_prompt_state"] = args.offload
    out_dir = Path(os.environ.get("OUT") or HERE / "results")
    name = f"cold_start_{args.preset}{'_pins' if args.pins else ''}"
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as children_out:
        if args.pins:
            pins = out_dir / "autotune_pins.json"
            after = out_dir / "autotune_pins_after_pinned.json"
            out_dir.mkdir(parents=True, exist_ok=True)
            if args.skip_tune:
                payload["pins"] = {p.name: json.loads(p.read_text()) for p in sorted(PINS_DIR.glob("*.json"))}
            else:
                layers = () if args.tiny else ("--layers", str(args.tune_layers))
                tune = run_case(
                    "tune",
                    Path(tmp) / "tune",
                    args,
                    Path(children_out),
                    [args.tune_prompt],
                    pins,
                    layers + measured,
                )
                payload["cases"].append(tune)
                payload["pins"] = json.loads(pins.read_text()) if pins.exists() else None
                if payload["pins"] and payload["pins"]["gpu"]:  # where the library looks for them
                    PINS_DIR.mkdir(exist_ok=True)
                    (PINS_DIR / f"{payload['pins']['gpu']}.json").write_text(pins.read_text())
                # and the specialisations it compiled, which the pinned process compiles ahead (compile_ahead.py)
                manifest = pins.with_name(pins.stem + "_compile_manifest.json")
                if manifest.exists() and json.loads(manifest.read_text()).get("gpu"):
                    MANIFEST_DIR.mkdir(exist_ok=True)
                    gpu = json.loads(manifest.read_text())["gpu"]
                    (MANIFEST_DIR / f"{gpu}.json").write_text(manifest.read_text())
                write_result(name, payload)
            payload["cases"].append(
                run_case(
                    "pinned",
                    Path(tmp) / "pinned",
                    args,
                    Path(children_out),
                    [args.prompt] * 2,
                    after,
                    measured,
                )
            )
            # the pinned process's choices: the pins it was given plus whatever it still had to tune (keys the tune
            # run never met, e.g. the measured step's response length); kept as the pins, so the next fresh machine
            # tunes none of them (a 512K step without them timed 33 configurations of 3 kernels)
            if after.exists() and json.loads(after.read_text()).get("gpu"):
                gpu = json.loads(after.read_text())["gpu"]
                (PINS_DIR / f"{gpu}.json").write_text(after.read_text())
                payload["pins_after_pinned"] = json.loads(after.read_text())
            # and the specialisations the pinned step compiled: exactly what a step needs (the tune process's
            # manifest also holds every configuration its autotuners timed)
            after_manifest = after.with_name(after.stem + "_compile_manifest.json")
            if after_manifest.exists() and json.loads(after_manifest.read_text()).get("gpu"):
                gpu = json.loads(after_manifest.read_text())["gpu"]
                (MANIFEST_DIR / f"{gpu}.json").write_text(after_manifest.read_text())
        else:
            cache_dir = Path(tmp) / "triton"
            for case in ("cold", "disk cache"):
                payload["cases"].append(
                    run_case(case, cache_dir, args, Path(children_out), [args.prompt] * 2, extra=measured)
                )
                write_result(name, payload)
        write_result(name, payload)
    rows = []
    for case in payload["cases"]:
        for i, s in enumerate(case["steps"]):
            rows.append(
                {
                    "case": case["case"],
                    "step": i + 1,
                    "ok": s.get("ok"),
                    "step s": f"{s.get('trainer_step_time_s', float('nan')):.1f}",
                    "capture s": _phase(s, "capture"),
                    "generation s": _phase(s, "generation"),
                    "replay s": _phase(s, "replay"),
                    "autotune s (process)": f"{case.get('autotune_s', 0):.1f}" if i == 0 else "",
                    "configs timed": case.get("autotune_configs_benchmarked", 0) if i == 0 else "",
                    "kernels compiled": case["kernels_compiled"] if i == 0 else "",
                    "compile s (process)": f"{case.get('compile_s', 0):.1f}" if i == 0 else "",
                }
            )
    print_table(rows)
    for case in payload["cases"]:
        slowest = sorted(case.get("compiled_by_kernel", {}).items(), key=lambda kv: -kv[1]["compile_s"])[:8]
        if slowest:
            print(f"{case['case']}: slowest to compile: " + ", ".join(
                f"{k} {v['compile_s']:.1f} s/{v['compiled']}" for k, v in slowest))  # fmt: skip
    for case in payload["cases"]:
        extra = [r for r in case.get("first_step_extra_by_stack", []) if r["step1_s"] - r["step2_s"] >= 0.2][
            :10
        ]
        if extra:
            print(f"{case['case']}: where step 1 spent more than step 2 (sampled stacks, innermost first):")
            for r in extra:
                print(
                    f"  +{r['step1_s'] - r['step2_s']:5.1f} s ({r['step1_s']:.1f} vs {r['step2_s']:.1f})  {r['stack']}"
                )
        if case.get("host_builds"):
            print(
                f"{case['case']}: host C builds (Triton launchers / utils): {case['host_builds']} in {case['host_build_s']:.1f} s"
            )
    for case in payload["cases"]:
        steps = [s for s in case["steps"] if s.get("ok")]
        if len(steps) == 2:  # the same step twice in one process: what being first cost
            ratio = steps[0]["train_s"] / steps[1]["train_s"]
            payload.setdefault("first_over_second", {})[case["case"]] = ratio
            print(
                f"{case['case']}: first step {steps[0]['train_s']:.1f} s, second {steps[1]['train_s']:.1f} s: x{ratio:.3f}"
            )
    write_result(name, payload)
    print(f"wrote {out_dir / f'{name}.json'}")
    sys.exit(0 if all(c["returncode"] == 0 and c["steps"] for c in payload["cases"]) else 1)


if __name__ == "__main__":
    main()
