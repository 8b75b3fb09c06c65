"""Short functions and modules of one concern, checked on the source: no function of the package or of a model patch
over 100 lines and no module of the package, the patches or the kernels over 800 lines (Triton kernel bodies, which
kernels/ holds, are exempt from the function bound)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 100
MAX_MODULE_LINES = 800


def _sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py") if not p.is_symlink())


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``name (lines)`` of every function in ``path`` longer than ``limit`` lines."""
    tree = ast.parse(path.read_text())
    return [
        f"{node.name} ({node.end_lineno - node.lineno + 1})"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > limit
    ]


@pytest.mark.parametrize(
    "path", _sources("longstraw_trl", "model_patches"), ids=lambda p: str(p.relative_to(ROOT))
)
def test_functions_are_short(path):
    assert long_functions(path) == []


@pytest.mark.parametrize(
    "path", _sources("longstraw_trl", "model_patches", "kernels"), ids=lambda p: str(p.relative_to(ROOT))
)
def test_modules_hold_one_concern(path):
    assert len(path.read_text().splitlines()) <= MAX_MODULE_LINES


def test_the_function_bound_catches_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def f():\n{body}\n\n\ndef g():\n    return 1\n")
    assert long_functions(tmp_path / "m.py") == [f"f ({MAX_FUNCTION_LINES + 1})"]
