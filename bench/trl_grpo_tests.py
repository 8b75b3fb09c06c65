"""Run TRL's own GRPO test file twice: against stock `GRPOTrainer`, and with `LongStrawGRPOTrainer` in its place.

    python bench/trl_grpo_tests.py --trl-git /path/to/trl/.git --trl-rev <commit> [-k EXPR]

TRL's tests are not vendored here and TRL's sdist carries none: the script reads `tests/test_grpo_trainer.py` and
the helpers it imports (`tests/__init__.py`, `conftest.py`, `testing_utils.py`, `testing_constants.py`) out of a git
clone of huggingface/trl at `--trl-rev` (or takes a checkout's `tests/` folder with `--trl-tests`), copies them to
`--work`, builds local stand-ins for the `trl-internal-testing/...` repos there (bench/trl_standins.py), and runs
pytest in that folder twice, in parallel: plain, and with `LONGSTRAW_SWAP=1` (bench/trl_grpo_swap.py swaps the
names the test module imports). Writes each test's outcome on both sides, the counts, and the tests stock passes and
ours does not with the first line of their error, to `--out` (bench/results/trl_grpo_tests_cpu.json).

Each run into a `--work` folder is logged there (`invocations.jsonl`) and listed in the JSON's `invocations`; each
test names the entries its two outcomes come from (`runs`). `--append` runs a `-k` subset on top of the earlier
lines (a test's newest line counts), `--sides ours` re-runs one side, and `--seed JSON` fills in, from an earlier
result JSON, the tests not yet run into the folder (as one more entry, with that JSON's own commands).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FILES = ["__init__.py", "conftest.py", "testing_utils.py", "testing_constants.py", "test_grpo_trainer.py"]

# Refused by design, each with the reason its error names (docs/guide.md, "Refused at construction").
BY_DESIGN = {
    "test_trust_remote_code": "custom-code architecture: LongStraw supports the model types it has patches for",
    "test_train_with_generation_kwargs": "num_beams > 1: beam search is not sampled from one captured prompt state",
}


def _git(git_dir: str, *args: str) -> str:
    return subprocess.run(
        ["git", "--git-dir", git_dir, *args], check=True, capture_output=True, text=True
    ).stdout


def extract_tests(args, dest: Path) -> dict:
    dest.mkdir(parents=True, exist_ok=True)
    if args.trl_tests:
        for name in FILES:
            if (Path(args.trl_tests) / name).is_file():
                shutil.copy(Path(args.trl_tests) / name, dest / name)
        return {"trl_tests": str(args.trl_tests), "trl_tests_commit": args.trl_rev}
    commit = _git(args.trl_git, "rev-parse", args.trl_rev).strip()
    for name in FILES:
        try:
            (dest / name).write_text(_git(args.trl_git, "show", f"{commit}:tests/{name}"))
        except subprocess.CalledProcessError:
            pass  # testing_constants.py is absent in older trees
    version = _git(args.trl_git, "show", f"{commit}:VERSION").strip()
    return {"trl_tests_commit": commit, "trl_tests_version_file": version}


def _read_ids(path: str) -> list[str]:
    return [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]


def _run_pytest(work: Path, tag: str, swap: bool, args, run_index: int) -> subprocess.Popen:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": str(args.threads),
        "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")]),
        "LONGSTRAW_SWAP": "1" if swap else "0",
        "LONGSTRAW_RESULTS": str(work / f"results_{tag}.jsonl"),
        "LONGSTRAW_TRL_BF16": "1" if args.bf16 else "0",
        "LONGSTRAW_RUN_INDEX": str(run_index),  # which entry of invocations.jsonl wrote a line
    }
    if not args.append:  # a rerun of one side replaces its lines
        (work / f"results_{tag}.jsonl").unlink(missing_ok=True)
    targets = ["tests/test_grpo_trainer.py"]
    if args.ids:  # exact test ids (`Class::test[param]`), one a line
        targets = [f"tests/test_grpo_trainer.py::{test_id}" for test_id in _read_ids(args.ids)]
    cmd = [sys.executable, "-m", "pytest", *targets, "-p", "no:cacheprovider", "-p",
           "trl_grpo_swap", "-q", "-rN", "--tb=short"]  # fmt: skip
    if args.k:
        cmd += ["-k", args.k]
    if args.xdist:
        cmd += ["-n", str(args.xdist)]
    log = open(work / f"pytest_{tag}.log", "w")  # noqa: SIM115 - closed by the OS at exit
    return subprocess.Popen(
        ["nice", "-n", "10", *cmd], cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT
    )


def parse_results(path: Path) -> dict[str, dict]:
    """The plugin's JSON lines. A later run's line for a test replaces an earlier run's (`--append` reruns); two
    consecutive lines of one test are one run's call and a failing teardown, which keeps the worse."""
    out: dict[str, dict] = {}
    if not path.is_file():
        return out
    previous = None
    for line in path.read_text().splitlines():
        row = json.loads(line)
        test = row.pop("test")
        row.setdefault("run", 0)
        if test != previous or out[test]["outcome"] in ("passed", "skipped"):
            out[test] = row
        previous = test
    return out


def seed(work: Path, seed_json: Path) -> None:
    """Import an earlier result JSON's per-test outcomes as one more entry of the invocation log, for the tests the
    JSON lines of `work` do not hold yet (so every later `--append` run replaces them): a whole-file table from runs
    made at different times, each test naming the run it comes from."""
    earlier = json.loads(seed_json.read_text())
    log_path = work / "invocations.jsonl"
    index = len(log_path.read_text().splitlines()) if log_path.is_file() else 0
    entry = {
        "seeded_from": str(seed_json),
        "invocations": earlier.get("invocations") or [{"command": earlier["command"]}],
        "git_revision": earlier.get("git_revision"),
        "date": earlier.get("date"),
    }
    for tag in ("stock", "ours"):
        have = parse_results(work / f"results_{tag}.jsonl")
        with open(work / f"results_{tag}.jsonl", "a") as f:
            for test, row in earlier["tests"].items():
                if test not in have:
                    f.write(json.dumps({"test": test, "outcome": row[tag],
                                        "message": row[f"{tag}_message"], "run": index}) + "\n")  # fmt: skip
    with open(log_path, "a") as f:
        f.write(json.dumps(entry) + "\n")


def _optional_packages() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("jmespath", "liger-kernel", "vllm", "peft", "bitsandbytes"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _by_design(test_id: str) -> str | None:
    return next((why for key, why in BY_DESIGN.items() if key in test_id), None)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trl-git", help="git directory of a huggingface/trl clone")
    parser.add_argument("--trl-rev", default="main", help="commit or ref whose tests/ to run")
    parser.add_argument("--trl-tests", help="instead of --trl-git: a checkout's tests/ folder")
    parser.add_argument("--work", default=os.path.expanduser("~/.cache/longstraw_trl/trl_grpo_tests"))
    parser.add_argument("-k", help="pytest -k expression (a subset)")
    parser.add_argument(
        "--ids", help="a file of test ids (`Class::test[param]`, one a line): run exactly these"
    )
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per pytest process")
    parser.add_argument("--deadline", type=float, default=3600.0, help="seconds before both runs are cut")
    parser.add_argument(
        "--bf16", action="store_true", help="keep TRL's bf16=True default (CPU autocast, slow)"
    )
    parser.add_argument(
        "--xdist", type=int, default=0, help="pytest-xdist workers per side (where installed)"
    )
    parser.add_argument(
        "--sides",
        default="stock,ours",
        help="which runs to make now (the other's JSON lines kept; '' reports only)",
    )
    parser.add_argument(
        "--append", action="store_true", help="add to the JSON lines of earlier runs (-k subsets)"
    )
    parser.add_argument("--out", default=str(HERE / "results" / "trl_grpo_tests_cpu.json"))
    parser.add_argument(
        "--seed",
        help="an earlier result JSON: its outcomes fill in the tests not run into --work yet (no pytest run)",
    )
    args = parser.parse_args()
    if not (args.trl_git or args.trl_tests):
        parser.error("give --trl-git (a huggingface/trl clone) or --trl-tests")

    import trl
    from trl_standins import build_standins

    work = Path(args.work)
    source = extract_tests(args, work / "tests")
    start = time.time()
    build_standins(work)
    standins_s = time.time() - start
    if args.seed:
        seed(work, Path(args.seed))
        args.sides, args.append = "", True
    sides = [side for side in args.sides.split(",") if side]
    log_path = work / "invocations.jsonl"
    if not args.append and len(sides) == 2:
        log_path.unlink(missing_ok=True)
    run_index = len(log_path.read_text().splitlines()) if log_path.is_file() else 0
    revision = subprocess.run(  # the code the run loads (commits made while it runs do not count)
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    if sides:  # the entry is reserved now, so a run started meanwhile (the other side, say) gets the next one
        with open(log_path, "a") as f:
            f.write(json.dumps({"running": " ".join(sys.argv[1:])}) + "\n")
    procs = {side: _run_pytest(work, side, side == "ours", args, run_index) for side in sides}
    codes = {}
    for tag, proc in procs.items():
        try:
            codes[tag] = proc.wait(timeout=max(1.0, start + args.deadline - time.time()))
        except subprocess.TimeoutExpired:  # cut at the deadline: the tests run so far still count
            proc.kill()
            codes[tag] = f"killed at the {args.deadline} s deadline"
    wall_s = time.time() - start
    # every run into this --work, in order: with --append the JSON reports the union of their JSON lines
    invocation = {
        "command": shlex.join([os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_revision": revision,
        "sides": sides,
        **({"ids": _read_ids(args.ids)} if args.ids else {}),
        "optional_packages": _optional_packages(),  # TRL's tests skip without them (require_*)
        "wall_s": round(wall_s, 1),
        "pytest_exit": codes,
    }
    invocations = [json.loads(line) for line in log_path.read_text().splitlines()]
    if sides:  # a report-only call (`--sides ''`, `--seed`) adds no run
        invocations[run_index] = invocation
        log_path.write_text("".join(json.dumps(entry) + "\n" for entry in invocations))
    stock, ours = (parse_results(work / f"results_{tag}.jsonl") for tag in ("stock", "ours"))
    if any(isinstance(c, str) for c in codes.values()):  # compare only what both sides ran
        stock = {t: r for t, r in stock.items() if t in ours}

    stock_pass = [t for t, r in stock.items() if r["outcome"] == "passed"]
    regressions = [
        {"test": t, "ours": ours.get(t, {}).get("outcome", "missing"), "message": ours.get(t, {}).get("message", ""),
         "by_design": _by_design(t)}
        for t in stock_pass if ours.get(t, {}).get("outcome") != "passed"
    ]  # fmt: skip
    count = {
        side: {o: sum(r["outcome"] == o for r in res.values()) for o in ("passed", "failed", "error", "skipped", "xfailed")}
        for side, res in (("stock", stock), ("ours", ours))
    }  # fmt: skip
    result = {
        **{key: invocation[key] for key in ("command", "date", "git_revision")},
        "invocations": invocations,
        "trl_version": trl.__version__,
        **source,
        "precision": "TRL's default (bf16 autocast on CPU)"
        if args.bf16
        else "fp32 on both sides (bf16=False)",
        "standins_s": round(standins_s, 1),
        # this call's pytest runs (none for a report-only call) and the time of every run listed
        "wall_s": round(wall_s, 1),
        "pytest_exit": codes,
        "runs_wall_s": round(sum(entry.get("wall_s", 0.0) for entry in invocations), 1),
        "counts": count,
        "stock_passes": len(stock_pass),
        "ours_passes_of_stock_passes": len(stock_pass) - len(regressions),
        "stock_pass_ours_not": regressions,
        "stock_pass_ours_not_by_design": sum(r["by_design"] is not None for r in regressions),
        "tests": {
            t: {
                "stock": stock[t]["outcome"],
                "ours": ours.get(t, {}).get("outcome", "missing"),
                "stock_message": stock[t]["message"],
                "ours_message": ours.get(t, {}).get("message", ""),
                "runs": [stock[t]["run"], ours.get(t, {}).get("run")],  # their entries in "invocations"
            }
            for t in stock
        },  # fmt: skip
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"stock passes {len(stock_pass)}; ours passes {result['ours_passes_of_stock_passes']} of them; "
          f"{len(regressions)} not ({result['stock_pass_ours_not_by_design']} refused by design); {wall_s:.0f} s")  # fmt: skip
    for r in regressions:
        print(
            f"  {r['test']}: {r['ours']}: {r['message'][:160]}" + (" [by design]" if r["by_design"] else "")
        )


if __name__ == "__main__":
    main()
