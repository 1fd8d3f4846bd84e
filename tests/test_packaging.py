"""Packaging: what pip's default build isolation builds against, and what the package requires.

The compiled extension loads only into the torch minor version it was compiled against. With
an unpinned ``torch`` build requirement, an isolated build (``pip install .``) fetched the newest
torch from PyPI (2.15.0, a CUDA build with several GB of nvidia packages) and compiled against
it, while the package claimed to run with ``torch>=2.4``: an extension that does not load.
"""
from __future__ import annotations

import os
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


def test_shipped_configs_install_with_the_package_and_resolve_by_name_outside_a_clone(tmp_path):
    """setup.py's build_py (what a wheel and ``pip install .`` copy into site-packages) carries
    every shipped config; from that copy, run in a folder with no ``configs/``, a name
    resolves and an unknown name lists the shipped ones."""
    from actnn_zoo.config import shipped_configs

    build = tmp_path / "build"
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(build)],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    package_dir = ROOT / "actnn_zoo" / "configs"
    names = shipped_configs()
    assert len(names) >= 9 and {"2bit", "4bit", "8bit", "actnn_l3"} <= set(names)
    built = sorted(p.name for p in (build / "actnn_zoo" / "configs").glob("*.yaml"))
    assert built == sorted(f"{n}.yaml" for n in names)
    for name in names:
        assert ((build / "actnn_zoo" / "configs" / f"{name}.yaml").read_bytes()
                == (package_dir / f"{name}.yaml").read_bytes())
    for ext in (ROOT / "actnn_zoo").glob("_C*.so"):  # the compiled kernels, built in place
        (build / "actnn_zoo" / ext.name).write_bytes(ext.read_bytes())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = (
        "import torch, actnn_zoo as az\n"
        "m = az.convert_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), '4bit')\n"
        "assert az.__file__.startswith(%r), az.__file__\n"
        "print(m[0].qconfig.bits)\n"
        "try:\n"
        "    az.convert_model(torch.nn.Linear(2, 2), 'configs/4bit.yaml')\n"
        "except FileNotFoundError as e:\n"
        "    print('missing:', e)\n"
        "try:\n"
        "    az.QuantConfig.from_name('5bit')\n"
        "except ValueError as e:\n"
        "    print('unknown:', e)\n" % str(build))
    out = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, check=True,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(build)}).stdout
    lines = out.splitlines()
    assert lines[0] == "4"
    assert lines[1].startswith("missing:") and "4bit" in lines[1]
    assert lines[2].startswith("unknown: unknown config name '5bit'")
    assert all(name in lines[2] for name in names)


def test_repository_configs_folder_is_the_package_folder():
    """Scripts, tests and docs name ``configs/<name>.yaml``: one copy of each file, no drift."""
    top, pkg = ROOT / "configs", ROOT / "actnn_zoo" / "configs"
    assert top.resolve() == pkg.resolve()


def test_the_just_in_time_build_compiles_what_setup_py_compiles():
    """``quant/backend.py`` builds the extension just in time where no prebuilt one loads: its
    source lists must be setup.py's, or the build links without a file's functions (it lacked
    attention_dropout_cpu.cpp, whose registration bindings.cpp calls)."""
    from actnn_zoo.quant import backend

    text = (ROOT / "setup.py").read_text()
    listed = re.findall(r'"cpp_ext/([\w.]+)"', text)
    cpu = {s for s in listed if s.endswith(".cpp")}
    cuda = {s for s in listed if s.endswith(".cu")}
    assert cpu == set(backend.CPU_SOURCES)
    assert cuda == set(backend.CUDA_SOURCES)
    assert all((ROOT / "cpp_ext" / s).exists() for s in cpu | cuda)
