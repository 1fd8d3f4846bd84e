"""Packaging: what pip's default build isolation builds against, and what the package requires.

The compiled extension loads only into the torch minor version it was compiled against. With
an unpinned ``torch`` build requirement, an isolated build (``pip install .``) fetched the newest
torch from PyPI (2.15.0, a CUDA build with several GB of nvidia packages) and compiled against
it, while the package claimed to run with ``torch>=2.4``: an extension that does not load.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def test_isolated_build_pins_the_torch_the_tests_run_with():
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    torch_reqs = [r for r in requires if re.match(r"torch\b", r)]
    assert len(torch_reqs) == 1
    pinned = re.fullmatch(r"torch==(\d+\.\d+\.\d+)", torch_reqs[0])
    assert pinned, f"build requirement {torch_reqs[0]!r} is not one exact torch version"
    assert _minor(pinned.group(1)) == _minor(torch.__version__)
    assert any(r.startswith("setuptools") for r in requires) and "ninja" in requires


def test_installed_package_requires_the_torch_minor_version_it_was_built_with(tmp_path):
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    requires = (next(tmp_path.glob("*.egg-info")) / "requires.txt").read_text().split()
    assert f"torch=={_minor(torch.__version__)}.*" in requires
    assert not any(r.startswith("torch>") for r in requires)
