"""The repository's layout never shadows an installed distribution: from the repository root (``python -m
longstraw_trl``, ``python -m pytest``) the working directory comes first on ``sys.path``, so a top-level folder with an
``__init__.py`` (or a top-level ``.py`` file) would be imported in place of a distribution of the same name, as a
``kernels/`` package once shadowed Hugging Face's ``kernels``, which transformers imports."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OWN = {"longstraw_trl"}


def importable_top_level(root: Path) -> set[str]:
    """Names a working directory of ``root`` makes importable as regular packages or modules."""
    names = {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    return names | {p.stem for p in root.glob("*.py")}


def shadowed(root: Path) -> dict[str, list[str]]:
    """Top-level names under ``root`` that an installed distribution also provides, with those distributions."""
    installed = importlib.metadata.packages_distributions()
    return {name: installed[name] for name in sorted(importable_top_level(root) - OWN) if name in installed}


def test_no_top_level_folder_shadows_an_installed_distribution():
    assert shadowed(ROOT) == {}


def test_the_check_finds_a_shadowing_folder(tmp_path):
    (tmp_path / "pytest").mkdir()  # a folder named like an installed distribution ...
    (tmp_path / "pytest" / "__init__.py").write_text("")
    (tmp_path / "kernels").mkdir()  # ... and one without an __init__.py, which an installed package outranks
    assert list(shadowed(tmp_path)) == ["pytest"]


def test_the_kernels_folder_is_a_subpackage_only():
    """``kernels/`` is ``longstraw_trl.kernels`` (setup.cfg's package_dir; ``longstraw_trl/kernels`` links to it in a
    checkout) and nothing else: it has no ``__init__.py`` that would make it the top-level ``kernels``."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    code = "import longstraw_trl.kernels.logprob as m; print(m.__name__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "longstraw_trl.kernels.logprob"
