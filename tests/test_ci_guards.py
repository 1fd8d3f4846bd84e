"""Guards that keep the CI run from hiding a gap.

* Under ``CI=true`` the CPU runs the compiled kernels (``actnn_zoo._C``), not the pure-torch
  reference: a build that silently failed would otherwise pass every test, only slower.
* No test file filters out the warning that announces the reference fallback (conftest.py
  turns it into an error under CI; a file's own ``ignore`` filter would win over that).
* The third-party packages the README's mappings are tested against (torchvision, timm,
  transformers) are installed in CI, so their tests run instead of skipping.
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from _ext import in_ci

TESTS = Path(__file__).resolve().parent


def test_compiled_kernels_back_the_cpu_under_ci():
    from actnn_zoo.quant import backend

    if not in_ci():
        pytest.skip("checks the CI environment (CI=true)")
    ext = backend.extension()
    assert ext is not None and ext.__name__ == "actnn_zoo._C", (
        f"CI runs {getattr(ext, '__name__', 'the reference kernels')}, not the prebuilt "
        "actnn_zoo._C: the extension did not build or load (scripts/setup_env.sh)")
    assert backend.kernels("cpu") is ext and backend.backend_name() in ("cpp", "cuda")


def test_no_test_filters_out_the_reference_kernel_warning():
    """A filter naming the fallback's message (or a blanket RuntimeWarning filter on
    'reference') in any test file would hide a run on the slow kernels."""
    pattern = re.compile(r"filterwarnings\([^)]*(using the slow|reference)", re.IGNORECASE)
    offenders = [f"{p.name}:{i}" for p in sorted(TESTS.glob("*.py"))
                 if p.name != Path(__file__).name
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not offenders, offenders


@pytest.mark.parametrize("module", ["torchvision", "timm", "transformers"])
def test_third_party_packages_installed_under_ci(module):
    if not in_ci():
        pytest.skip("checks the CI environment (CI=true)")
    assert importlib.util.find_spec(module) is not None, (
        f"{module} is not importable: scripts/setup_env.sh installs it (torchvision and timm "
        "into .bench_deps) so that the third-party tests run in CI")
