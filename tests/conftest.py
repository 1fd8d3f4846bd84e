"""Session-wide test setup: CI guards, and torchvision importable with a CPU torch.

* Under ``CI=true`` the slow pure-torch reference kernels must not stand in for the compiled
  ones: the warning ``actnn_zoo: using the slow pure-torch reference kernels`` (issued once, when
  the compiled extension cannot be had) is an error there, and
  tests/test_ci_guards.py checks the backend itself. Off CI the warning is left alone.
* torchvision's PyPI wheels are built against a CUDA torch: with the CPU torch of the test
  environment its compiled operators do not load and ``import torchvision`` (also reached
  through ``import timm`` and some ``transformers`` models) fails with ``operator
  torchvision::nms does not exist``. Its model definitions are pure Python and work once the
  two operator schemas it registers fake kernels for exist;
  ``scripts/third_party.py:import_vision`` defines them before the import. Doing that once here,
  before any test imports torchvision, makes the third-party tests run rather than fail.
"""
from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest

from _ext import in_ci

# Where scripts/setup_env.sh installs torchvision and timm (outside the venv, see there).
BENCH_DEPS = Path(__file__).resolve().parents[1] / ".bench_deps"
# A regex for the start of the message; "." for its ":", which separates the filter's fields.
SLOW_KERNELS_WARNING = "actnn_zoo. using the slow pure-torch reference kernels"


def pytest_configure(config: pytest.Config) -> None:
    if in_ci():
        # A later "ignore" for the same message (a test's own filter) would win; tests must not
        # carry one (tests/test_ci_guards.py checks).
        config.addinivalue_line("filterwarnings",
                                f"error:{SLOW_KERNELS_WARNING}:RuntimeWarning")
    if importlib.util.find_spec("torchvision") is not None or BENCH_DEPS.is_dir():
        from _scripts import load_script

        with warnings.catch_warnings():  # torchvision warns that its image ops did not load
            warnings.simplefilter("ignore")
            load_script("third_party.py").import_vision()


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny ops: with 2 OpenMP threads on a busy 2-core machine
    they spin (~100 ms per tiny convolution), and timing-sensitive loops get unstable. Used as
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
