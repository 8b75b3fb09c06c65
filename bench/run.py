"""The benchmark suites behind one entry point: the device set-up, then one suite's commands.

    LONGSTRAW_REV=$(git rev-parse --short HEAD) python3 bench/run.py <suite> [options] [script arguments]
    python3 bench/run.py --list                      # the suites, what each measures, against what
    python3 bench/run.py full-model --dry-run ...    # print the commands only (no set-up, no GPU)

Run from the repository root of a GPU machine's copy of the checkout, with the wheels of the pinned stack in
``.whl/``. The set-up installs them once per machine into ``/tmp/site`` (flash-linear-attention apart, into
``/tmp/fla``: only the suites whose layers should train through it put it on ``PYTHONPATH``), installs the
checkout (``pip install -e .``), keeps Triton's compiled kernels in ``.triton_cache/`` of the checkout (a warm
machine then does not compile again), and writes ``nvidia-smi``'s view of the GPU to ``$OUT/gpu.txt``. Result
JSONs and logs go to ``$OUT`` (default ``/tmp/out``). ``LONGSTRAW_REV`` stamps each result with the revision the
checkout was taken from (the device copy may have no ``.git``).

Options a suite does not know go to its script, after the suite's defaults, so that they win (argparse keeps the
last value): ``full-model --offload cpu --chunk 8192 --response 32`` is the reference step with the prompt state on
the host and 8K chunks, R = 32.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE, FLA = "/tmp/site", "/tmp/fla"
WHEELS_STAMP = Path(SITE) / ".longstraw_wheels"
# NVLink multicast off: NCCL's NVLS and symmetric-memory multicast are not available on every host
DEVICE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# the whole 27B's train() step at P = 262,144 in both gradient modes, each phase beside its floor
FULL_MODEL_REFERENCE = (
    "--skip-stock --prompts 262144 --response 256 --gradient-modes response_only full "
    "--warmup-prompt 16384 --warmup-response 8 --budget-s 560"
).split()


@dataclass
class Step:
    """One command of a suite: run in ``bench/`` (or the root), its output filtered into ``$OUT/<log>``."""

    argv: list[str]
    log: str
    timeout: int
    fla: bool = True  # flash-linear-attention on PYTHONPATH
    tail: int = 12  # lines of the log printed at the end
    cwd: str = "bench"
    env: dict[str, str] = field(default_factory=dict)
    path: tuple[str, ...] = ()  # ahead of the installed packages on PYTHONPATH (a baseline checkout)


@dataclass
class Suite:
    """A named benchmark: what it measures and against which floor or reference, and how to build its steps."""

    name: str
    help: str
    build: object  # (options, script arguments) -> list[Step]
    options: tuple = ()  # (flags, argparse keywords) of the suite's own options


def _py(*args: str) -> list[str]:
    return ["python3", "-u", *args]


def _last(args: list[str], flag: str, default: str = "") -> str:
    """The value argparse keeps for ``flag`` in ``args`` (the last one)."""
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]
    return values[-1] if values else default


def gpu_token() -> str:
    """``h100`` / ``h200`` / ... from nvidia-smi's first GPU name (``gpu`` where there is none)."""
    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
    except FileNotFoundError:
        return "gpu"
    words = names.stdout.split()
    return next((w.lower() for w in words if w[:1] in "HABL" and w[1:].isdigit()), "gpu")


def _result_tag(args: list[str]) -> str:
    tag = f"_{gpu_token()}_P{_last(args, '--prompts')}"
    tag += "_offload" if _last(args, "--offload") == "cpu" else ""
    return tag + ("_defaults" if "--library-defaults" in args else "")


def _gpu_tests(opts, rest):
    tag = f"_{opts.log_tag}" if opts.log_tag else ""
    pytest = [
        "python3",
        "-m",
        "pytest",
        "-v",
        "-rfE",
        "-m",
        "gpu",
        "--durations",
        "10",
        *(rest or ["tests/"]),
    ]
    return [Step(pytest, f"pytest_gpu_tests{tag}.log", opts.timeout or 400, cwd=".", tail=10)]


def _engine(opts, rest):
    args = ["--preset", "qwen3.6-27b", "--prompt", "131072", "524288", "1048576", "2097152", "--groups", "8"]
    return [Step(_py("engine_slice.py", *args, *rest), "engine.log", opts.timeout or 450)]


def _compare_stock(opts, rest):
    if opts.one_sequence:  # stock times one of its G sequences where G of them do not fit one command
        args = ["--preset", "qwen3.6-27b", "--prompts", "131072", "262144", "--stock-sequences", "1"]
        return [
            Step(
                _py("compare_stock.py", *args, "--budget-s", "200", *rest), "compare_27b.log", 220, fla=False
            )
        ]
    runs = [
        ("qwen3-8b", ["32768", "131072", "524288", "1048576"]),
        ("qwen3.6-27b", ["32768", "131072", "262144"]),
    ]
    return [
        Step(
            _py("compare_stock.py", "--preset", p, "--prompts", *ps, "--budget-s", "190", *rest),
            f"compare_{p}.log",
            230,
            fla=False,
        )
        for p, ps in runs
    ]


def _full_model(opts, rest):
    if (
        opts.stock
    ):  # stock TRL's GRPOTrainer on the whole model until it runs out of memory; its layers without fla
        argv = _py("full_model.py", "--skip-longstraw", "--tag", "_stock", *rest)
        return [Step(argv, "full_model_stock.log", opts.timeout or 590, fla=False, tail=16)]
    args = [*FULL_MODEL_REFERENCE, *rest]
    if "--tag" not in args:  # the result file's name: full_model_<model>_<gpu>_P<prompt>[_offload].json
        args += ["--tag", _result_tag(args)]
    steps = [Step(_py("full_model.py", *args), "full_model.log", opts.timeout or 590, tail=8)]
    out = os.environ.get("OUT", "/tmp/out")
    if (
        opts.baseline
    ):  # the same step from another checkout first, in its own process, its files in $OUT/baseline
        tree = Path(opts.baseline).resolve()
        if not opts.dry_run:
            link_subpackages(tree)
        extra = shlex.split(opts.baseline_args or "")
        base = _baseline_step(tree, steps[0], f"{out}/baseline", opts.baseline_rev, extra)
        steps = _alternating(base, steps[0], opts.pairs, out)
    # the full gradient's prompt backward: seconds against both floors, its segments (an estimate if cut)
    steps.append(
        Step(_py("pb_summary.py", f"{out}/full_model_*.json"), "full_model_summary.txt", 60, tail=40)
    )
    return steps


def link_subpackages(tree: Path) -> None:
    """Make the checkout ``tree`` importable from PYTHONPATH alone: setup.cfg's package_dir installs kernels/ and
    model_patches/ as longstraw_trl.kernels / .model_patches, which a checkout reaches through links in longstraw_trl/
    (this revision carries the kernels one; an older checkout gets both)."""
    for sub in ("kernels", "model_patches"):
        link = tree / "longstraw_trl" / sub
        if (tree / sub).is_dir() and not link.exists():
            link.symlink_to(Path("..") / sub)


#: full_model.py flags that ask for what an older revision always did (``--stream-all-layers``: every offloaded layer
#: streams); a baseline checkout whose script lacks one runs without it
BASELINE_DEFAULT_FLAGS = ("--stream-all-layers",)


def _alternating(base: Step, ours: Step, pairs: int, out: str) -> list[Step]:
    """``pairs`` pairs of the baseline's step and ours, in the order base, ours, ours, base, base, ours, ... (each
    side first as often as second, so that what the first process of a machine pays falls on both); with more than
    one pair, each run's files in ``$OUT/baseline/<i>`` and ``$OUT/run<i>``."""
    if pairs < 1:
        raise SystemExit(f"--pairs must be >= 1, got {pairs}")
    if pairs == 1:
        return [base, ours]
    steps = []
    for i in range(pairs):
        b = dataclasses.replace(
            base, env=dict(base.env, OUT=f"{out}/baseline/{i}"), log=f"baseline{i}_{ours.log}"
        )
        o = dataclasses.replace(ours, env=dict(ours.env, OUT=f"{out}/run{i}"), log=f"run{i}_{ours.log}")
        steps += [b, o] if i % 2 == 0 else [o, b]
    return steps


def _baseline_step(
    tree: Path, step: Step, out: str, revision: str | None, extra: list[str] | None = None
) -> Step:
    """``step`` run from the checkout ``tree`` (another revision's files, e.g. ``git archive <rev> | tar -x``), with
    ``tree`` first on PYTHONPATH, its result files under ``out`` and ``revision`` recorded in them; ``extra``:
    arguments for the baseline's script only (e.g. ``--stream-all-layers`` with this checkout as the baseline)."""
    env = dict(step.env, OUT=out, **({"LONGSTRAW_REV": revision} if revision else {}))
    script = (
        (tree / "bench" / "full_model.py").read_text() if (tree / "bench" / "full_model.py").is_file() else ""
    )
    argv = [a for a in step.argv if a not in BASELINE_DEFAULT_FLAGS or a in script] + list(extra or [])
    return Step(
        argv,
        "baseline_" + step.log,
        step.timeout,
        step.fla,
        step.tail,
        str(tree / "bench"),
        env,
        (str(tree),),
    )


def _full_gradient(opts, rest):
    if rest:
        return [Step(_py("full_gradient.py", *rest), "full_gradient.log", opts.timeout or 400, tail=45)]
    # the bf16 check against stock first (without fla: the stock layers would train through its backward)
    return [
        Step(
            _py("full_gradient.py", "--prompt", "--check", "4096", "--tag", "_check"),
            "grad_check.log",
            60,
            fla=False,
            tail=2,
        ),
        Step(
            _py("full_gradient.py", "--prompt", "524288", "--check", "0", "--tag", "_512K"),
            "grad_512k.log",
            170,
            tail=6,
        ),
        Step(
            _py(
                "full_gradient.py",
                "--prompt",
                "--check",
                "0",
                "--long-response",
                "65536",
                "--block",
                "4096",
                "--tag",
                "_R64K",
            ),
            "grad_r64k.log",
            120,
            tail=5,
        ),
        Step(
            _py("full_gradient.py", "--prompt", "1048576", "--check", "0", "--tag", "_1M"),
            "grad_1m.log",
            200,
            tail=5,
        ),
    ]


def _glm(opts, rest):
    if not opts.train:
        args = ["--prompt", str(opts.prompt or 1048576), "--gen-tokens", "256", "--budget-s", "290"]
        return [
            Step(_py("glm_slice.py", *args, *rest), "glm_slice.log", opts.timeout or 300, fla=False, tail=8)
        ]
    ranks = opts.ranks
    prompt = opts.prompt or {1: 524288, 2: 1048576, 8: 2097152}[ranks]
    warm = 131072 if ranks == 8 else 65536  # under CP8 a 16K page a rank
    limit = opts.timeout or 590
    args = [
        *("--preset", "glm-5", "--layers", str(opts.layers), "--skip-stock", "--prompts", str(prompt)),
        *(
            "--response",
            "256",
            "--warmup-prompt",
            str(warm),
            "--warmup-response",
            "16",
            "--budget-s",
            str(limit - 30),
        ),
        *rest,
    ]
    if ranks == 1:
        argv = _py("full_model.py", *args)
    else:  # the experts split over the CP group (ep_size = cp_size), the prompt pages over its ranks
        launch = ["-m", "accelerate.commands.launch", "--mixed_precision", "bf16"]
        config = f"../examples/accelerate/cp{ranks}.yaml"
        argv = _py(
            *launch,
            "--config_file",
            config,
            "full_model.py",
            *args,
            "--cp-size",
            str(ranks),
            "--ep-size",
            str(ranks),
        )
    return [Step(argv, "glm_train.log", limit)]


def _cold_start(opts, rest):
    if opts.pins:  # this GPU's autotune pins (a 32K step), then a pinned cold step against the warm one
        argv = _py("cold_start.py", "--pins", "--prompt", "524288", "--budget-s", "420", *rest)
        return [Step(argv, "cold_pins.log", opts.timeout or 580)]
    return [Step(_py("cold_start.py", *rest), "cold_start.log", opts.timeout or 560)]


def _agents(opts, rest):
    if opts.turns:
        return [Step(_py("agent_turns.py", *rest), "agent_turns.log", opts.timeout or 500)]
    return [Step(_py("prefix_tree.py", *rest), "prefix_tree.log", opts.timeout or 470, tail=30)]


FSDP_MODES = ("plain", "world1", "cp2", "fsdp2-cp2", "fsdp2-cp8")


def _fsdp(opts, rest):
    mode = opts.mode
    prompt = opts.prompt or (2097152 if mode == "fsdp2-cp8" else 524288)
    limit = opts.timeout or 590
    response = "2048" if mode == "fsdp2-cp8" else "256"
    common = [
        "--skip-stock",
        "--prompts",
        str(prompt),
        "--response",
        response,
        "--budget-s",
        str(limit - 30),
        *rest,
    ]
    launch = ["-m", "accelerate.commands.launch", "--mixed_precision", "bf16", "--config_file"]
    cfg = "../examples/accelerate/"
    argv = {
        "plain": _py("full_model.py", *common, "--tag", f"_plain_P{prompt}"),
        "world1": _py(
            *launch,
            cfg + "fsdp2.yaml",
            "--num_processes",
            "1",
            "full_model.py",
            *common,
            "--tag",
            f"_fsdp_P{prompt}",
        ),
        "cp2": _py(*launch, cfg + "cp2.yaml", "full_model.py", *common, "--cp-size", "2", "--tag", "_cp2"),
        "fsdp2-cp2": _py(
            *launch,
            cfg + "fsdp2.yaml",
            "--num_processes",
            "2",
            "full_model.py",
            *common,
            "--cp-size",
            "2",
            "--tag",
            "_fsdp2_cp2",
        ),
        "fsdp2-cp8": _py(
            *launch,
            cfg + "fsdp2_cp8.yaml",
            "full_model.py",
            "--lora-rank",
            "0",
            "--warmup-prompt",
            "131072",
            "--warmup-response",
            "32",
            *common,
            "--cp-size",
            "8",
            "--tag",
            f"_fsdp2_cp8_full_finetune_P{prompt}",
        ),  # fmt: skip
    }[mode]
    return [Step(argv, f"fsdp_{mode}.log", limit, tail=16)]


def after_fsdp(opts, out: Path) -> None:
    """The plain step's JSON waits in /tmp (kept on a warm machine); world1's step is compared with it: FSDP2 at
    world size 1 must stay within 5% of the plain step's time."""
    prompt = opts.prompt or 524288
    plain = Path(f"/tmp/full_model_qwen3.6-27b_plain_P{prompt}.json")
    if opts.mode == "plain" and (out / plain.name).is_file():
        plain.write_bytes((out / plain.name).read_bytes())
    fsdp_json = out / f"full_model_qwen3.6-27b_fsdp_P{prompt}.json"
    if opts.mode != "world1" or not (plain.is_file() and fsdp_json.is_file()):
        return
    fsdp, base = (json.loads(p.read_text())["longstraw"][-1] for p in (fsdp_json, plain))
    if "train_s" not in fsdp or "train_s" not in base:  # a failed, OOM or cut step: say which, no ratio
        why = [r.get("status") or r.get("error") or r.get("oom") for r in (fsdp, base)]
        print(f"no comparison: FSDP2 step {why[0]}, plain step {why[1]}")
        return
    ratio = fsdp["train_s"] / base["train_s"]
    lines = [
        f"FSDP2 world 1: {fsdp['train_s']:.1f} s, plain {base['train_s']:.1f} s: x{ratio:.3f} "
        f"({'within' if ratio <= 1.05 else 'OVER'} the 5% budget); peak {fsdp['peak_gib']:.1f} vs "
        f"{base['peak_gib']:.1f} GiB",
        *(
            f"  {k}: {fsdp['phases'][k]['seconds']:.1f} s vs {base['phases'][k]['seconds']:.1f} s"
            for k in fsdp["phases"]
        ),
    ]
    print("\n".join(lines))
    (out / "fsdp_vs_plain.txt").write_text("\n".join(lines) + "\n")


def _cp(opts, rest):
    run = ["python3", "-u", "-m", "torch.distributed.run", "--nproc_per_node"]
    if opts.check:  # the sharded state's log-probs and gradients against one rank, two gloo ranks on one GPU
        argv = [*run, "2", "cp_slice.py", "--check-only", "--backend", "gloo", *rest]
        return [Step(argv, "cp_check.log", opts.timeout or 100, fla=False)]
    args = ["--preset", "qwen3.6-27b", "--prompt", str(opts.prompt or 2097152)]
    return [
        Step(
            [*run, str(opts.ranks), "cp_slice.py", *args, *rest],
            "cp.log",
            opts.timeout or 560,
            fla=False,
            tail=16,
        )
    ]


def _real_long(opts, rest):
    """Gemma-3-270M on the long-facts task, one GPU: one call of real_long.py, stopped cleanly before its timeout; the
    next call with the same --state-dir goes on where it stopped."""
    limit = opts.timeout or 560
    prompt, budget = str(opts.prompt or 16384), str(limit - 45)
    args = ["--prompt", prompt, "--budget-s", budget, "--state-dir", opts.state_dir]
    args += ["--cache-dir", opts.cache_dir]
    env = {"TQDM_DISABLE": "1", "LONGSTRAW_CACHE": opts.cache_dir}
    return [Step(_py("real_long.py", *args, *rest), "real_long.log", limit, fla=False, tail=24, env=env)]


_timeout = (("--timeout",), dict(type=int, help="seconds for the script (default: the suite's)"))
_prompt = (("--prompt",), dict(type=int, help="prompt tokens P (default: the suite's)"))
SUITES = {
    s.name: s
    for s in [
        Suite(
            "gpu-tests",
            "The GPU tests (pytest -m gpu) of the files given (default tests/), fla on the path as in a whole-model "
            "run. Reference: each fast kernel against its reference implementation, the engine against stock HF.",
            _gpu_tests,
            (_timeout, (("--log-tag",), dict(default="", help="suffix of the log's name"))),
        ),
        Suite(
            "engine",
            "The engine alone on a 4-layer Qwen3.6-27B slice (real layer dimensions), P = 128K..2M, G = 8: peak "
            "memory, state bytes, capture / generation / replay seconds. Floors: the capture's attention at the "
            "causal SDPA rate and the copies at the bandwidth measured in the same run; the peak must not grow with G.",
            _engine,
            (_timeout,),
        ),
        Suite(
            "compare-stock",
            "LongStraw against stock TRL's GRPOTrainer on 4-layer Qwen3-8B and Qwen3.6-27B slices: the largest P "
            "that fits and the step time at equal P. Reference: stock TRL with its defaults, same model, prompt, "
            "completions and advantages.",
            _compare_stock,
            (
                (
                    ("--one-sequence",),
                    dict(action="store_true", help="stock times one of its G sequences (27B, 128K/256K)"),
                ),
            ),
        ),
        Suite(
            "full-model",
            "The whole Qwen3.6-27B (64 layers), LoRA r = 64, one LongStrawGRPOTrainer.train() step per P after a "
            "warm-up step; default: P = 262,144, response-only then full gradient. Each phase (capture, generation, "
            "replays, prompt backward, optimizer) beside its floor from rates measured in the process; peak against "
            "`longstraw plan`. --stock: stock TRL on the same model until it runs out of memory.",
            _full_model,
            (
                _timeout,
                (("--stock",), dict(action="store_true", help="stock TRL's GRPOTrainer instead")),
                (
                    ("--baseline",),
                    dict(
                        metavar="DIR",
                        help="a checkout of another revision: its step runs first, in its own process on the same "
                        "GPU (results in $OUT/baseline/), so that the two revisions' phases compare side by side",
                    ),
                ),
                (
                    ("--pairs",),
                    dict(
                        type=int,
                        default=1,
                        help="with --baseline: this many pairs, alternating which side runs first (base, ours, ours, "
                        "base, ...), each run's files in $OUT/baseline/<i> and $OUT/run<i>",
                    ),
                ),
                (
                    ("--baseline-args",),
                    dict(
                        default="",
                        metavar="ARGS",
                        help="with --baseline: more arguments for the baseline's script only, e.g. "
                        "--baseline-args=--stream-all-layers with --baseline . to measure keeping layers on the GPU",
                    ),
                ),
                (
                    ("--baseline-rev",),
                    dict(metavar="REV", help="the baseline checkout's git revision, recorded"),
                ),
            ),
        ),
        Suite(
            "full-gradient",
            "gradient_mode='full' on a 4-layer Qwen3.6-27B slice: the bf16 gradient against stock's full-sequence "
            "gradient (the reference), then P = 512K and 1M in both modes and one R = 65,536 response (reverse "
            "block replay against a whole replay). Script arguments instead run full_gradient.py with them.",
            _full_gradient,
            (_timeout,),
        ),
        Suite(
            "glm",
            "GLM-5 (MLA + DSA indexer + MoE) on a 3-layer slice: capture, generation and replay at P = 1M with the "
            "prompt state on the GPU and on the host, each against its floor (the copies hidden behind compute). "
            "--train: the slice through LongStrawGRPOTrainer.train() (--ranks 2 or 8: EP x CP under Accelerate), "
            "peak against the plan a rank.",
            _glm,
            (
                _timeout,
                _prompt,
                (
                    ("--train",),
                    dict(action="store_true", help="the train() step instead of the engine slice"),
                ),
                (
                    ("--ranks",),
                    dict(type=int, default=1, choices=(1, 2, 8), help="processes (EP = CP = ranks)"),
                ),
                (("--layers",), dict(type=int, default=4, help="layers of the train() slice")),
            ),
        ),
        Suite(
            "cold-start",
            "What a fresh process's first step pays: the whole 27B's train() step on an empty Triton cache, then "
            "on the same cache from disk. Reference: the second (warm) step of the same process. --pins: measure "
            "this GPU's autotune pins, then a pinned cold step at 512K.",
            _cold_start,
            (
                _timeout,
                (("--pins",), dict(action="store_true", help="autotune pins first, then a pinned cold step")),
            ),
        ),
        Suite(
            "agents",
            "Prefix sharing on a 4-layer Qwen3.6-27B slice: 8 decision points of one 512K trajectory captured once "
            "and extended, against whole captures of each (the reference). --turns: G = 8 rollouts with three tool "
            "turns each on a 512K prompt, each turn extending the rollout's state.",
            _agents,
            (_timeout, (("--turns",), dict(action="store_true", help="tool turns (agent_turns.py)"))),
        ),
        Suite(
            "fsdp",
            "The whole 27B's LoRA step under FSDP2. --mode plain, then --mode world1 on the same machine: FSDP2 at "
            "world size 1 (every hook, trivial collectives) must stay within 5% of the plain step. cp2 / fsdp2-cp2 "
            "on 2 GPUs, fsdp2-cp8 (full fine-tuning at 2M) on 8: peak a rank against the plan.",
            _fsdp,
            (_timeout, _prompt, (("--mode",), dict(default="plain", choices=FSDP_MODES, help="which step"))),
        ),
        Suite(
            "real-long",
            "Real weights at real length: Gemma-3-270M (LoRA r = 16) on a long-context retrieval task (facts with "
            "distractors, exact answers, held-out documents) at P = 16K by default (--prompt, up to 32,000) on one GPU: "
            "stock GRPOTrainer beside LongStrawGRPOTrainer with gradient_mode='full' and the response-only default, "
            "same data, seeds and steps: held-out accuracy before/after, reward curves, seconds per step by phase, "
            "peak memory; then the response-only, full and stock gradients' cosines at 4K-32K. Reference: our "
            "log-probs against the stock forward at the longest length. Resumable: call again with the same "
            "--state-dir until it prints 'remaining runs: none'.",
            _real_long,
            (
                _timeout,
                _prompt,
                (("--state-dir",), dict(default="/tmp/longstraw_real_long", help="its state")),
                (("--cache-dir",), dict(default="/tmp/longstraw_cache", help="LONGSTRAW_CACHE")),
            ),
        ),
        Suite(
            "cp",
            "Context parallelism on a 4-layer Qwen3.6-27B slice (torch.distributed.run): the prompt pages spread over "
            "the ranks at P = 2M. Reference: --check, the sharded state's log-probs against one rank and the "
            "gradients identical on every rank (two gloo ranks on one GPU).",
            _cp,
            (
                _timeout,
                _prompt,
                (("--ranks",), dict(type=int, default=2, help="processes (GPUs)")),
                (("--check",), dict(action="store_true", help="the correctness check only")),
            ),
        ),
    ]
}


def parse(argv: list[str]) -> tuple[Suite, argparse.Namespace, list[str]]:
    """The suite, its own options (plus ``dry_run`` / ``no_setup``) and the arguments left for its script."""
    runner = [a for a in argv if a in ("--dry-run", "--no-setup")]
    argv = [a for a in argv if a not in runner]
    if not argv or argv[0] not in SUITES:
        ap = argparse.ArgumentParser(
            prog="bench/run.py",
            description=__doc__.split("\n\n")[0],
            epilog="suites:\n"
            + "\n".join(f"  {n:14s} {s.help.split('. ')[0].rstrip('.')}." for n, s in SUITES.items()),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        ap.add_argument(
            "suite", choices=SUITES, metavar="suite", help="one of the suites below (--list: all of each)"
        )
        ap.add_argument(
            "--dry-run", action="store_true", help="print the commands, set nothing up, run nothing"
        )
        ap.add_argument(
            "--no-setup", action="store_true", help="skip the installs (an environment already set up)"
        )
        ap.parse_args(argv)  # prints the usage and exits
    suite = SUITES[argv[0]]
    own = argparse.ArgumentParser(
        prog=f"bench/run.py {suite.name}", description=suite.help, allow_abbrev=False
    )
    for flags, kw in suite.options:
        own.add_argument(*flags, **kw)
    opts, script_args = own.parse_known_args(argv[1:])
    opts.dry_run, opts.no_setup = "--dry-run" in runner, "--no-setup" in runner
    return suite, opts, script_args


def install_wheels() -> None:
    """The pinned wheels of ``.whl/`` into /tmp/site (fla into /tmp/fla), once per machine and wheel set."""
    wheels = sorted(p.name for p in (ROOT / ".whl").glob("*.whl"))
    fla = [f".whl/{w}" for w in wheels if "fla_core" in w or "flash_linear" in w]
    rest = [f".whl/{w}" for w in wheels if f".whl/{w}" not in fla]
    listing = "".join(f"{w}\n" for w in sorted(os.listdir(ROOT / ".whl")))
    if WHEELS_STAMP.is_file() and WHEELS_STAMP.read_text() == listing:
        return
    pip = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
    ]
    for target, files in ((SITE, rest), (FLA, fla)):
        subprocess.run([*pip, "--upgrade", "--target", target, *files], cwd=ROOT, check=True)
    WHEELS_STAMP.write_text(listing)


def set_up(out: Path, install: bool) -> dict[str, str]:
    """The environment every suite runs in; installs the wheels and the checkout first."""
    out.mkdir(parents=True, exist_ok=True)
    if install:
        install_wheels()
    env = dict(
        os.environ, TRITON_CACHE_DIR=str(ROOT / ".triton_cache"), PYTHONPATH=SITE, OUT=str(out), **DEVICE_ENV
    )
    if install:
        editable = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
        ]
        subprocess.run([*editable, "-e", "."], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    query = ["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.sm", "--format=csv"]
    try:
        (out / "gpu.txt").write_text(subprocess.run(query, capture_output=True, text=True).stdout)
    except FileNotFoundError:
        pass
    return env


def run_step(step: Step, env: dict[str, str], out: Path) -> int:
    """``timeout <s> <argv>``, lines that mention warnings dropped, into ``$OUT/<log>``; the last lines printed."""
    env = dict(env, **step.env)
    env["PYTHONPATH"] = ":".join([*step.path, SITE, *([FLA] if step.fla else [])])
    tail: collections.deque[str] = collections.deque(maxlen=step.tail)
    cwd = ROOT / step.cwd
    with open(out / step.log, "w") as log:
        proc = subprocess.Popen(
            ["timeout", str(step.timeout), *step.argv], cwd=cwd, env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        for line in proc.stdout:
            if "warn" in line.lower():
                continue
            log.write(line)
            tail.append(line)
        rc = proc.wait()
    print(f"$ {shlex.join(step.argv)}  (in {step.cwd}/, rc={rc}, log {step.log})")
    print("".join(tail), end="", flush=True)
    return rc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--list"]:
        for name, suite in SUITES.items():
            print(f"{name}\n    {suite.help}\n")
        return 0
    suite, opts, script_args = parse(argv)
    steps = suite.build(opts, script_args)
    if opts.dry_run:
        for step in steps:
            path = ":".join([*step.path, SITE, *([FLA] if step.fla else [])])
            print(f"(cd {step.cwd} && PYTHONPATH={path} timeout {step.timeout} {shlex.join(step.argv)})")
        return 0
    if not os.environ.get("LONGSTRAW_REV"):
        print(
            "LONGSTRAW_REV is not set: results record the device copy's revision, if it has one",
            file=sys.stderr,
        )
    out = Path(os.environ.get("OUT") or "/tmp/out")
    env = set_up(out, install=not opts.no_setup)
    rc = max(run_step(step, env, out) for step in steps)
    if suite.name == "fsdp":
        after_fsdp(opts, out)
    return rc


if __name__ == "__main__":
    sys.exit(main())
