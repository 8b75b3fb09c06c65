"""Every example answers ``--help`` before torch and transformers load (seconds saved), and picks a thread count that
suits the machine."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _examples import EXAMPLES, load_example

SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))

# runs the script as `python examples/NAME --help` would, then says which heavy modules got imported
PROBE = """
import runpy, sys
path = sys.argv[1]
sys.argv = [path, "--help"]
sys.path.insert(0, {examples!r})
try:
    runpy.run_path(path, run_name="__main__")
except SystemExit as e:
    assert e.code in (0, None), e.code
print("heavy:", sorted(m for m in ("torch", "transformers", "trl", "datasets") if m in sys.modules))
"""


def test_every_example_is_covered():
    assert {"agent_trajectories.py", "capture_replay.py", "grpo_lockers.py", "grpo_needle.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_answers_before_the_heavy_imports(script):
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(examples=str(EXAMPLES)), str(EXAMPLES / script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: "), proc.stdout[:500]
    assert "--threads" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "heavy: []", proc.stdout[-500:]


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (4, 0), (64, 0)])
def test_default_threads_is_one_on_two_cores_or_fewer(cores, threads):
    assert load_example("_common").default_threads(cores) == threads
