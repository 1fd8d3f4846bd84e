"""Third-party model zoos for benchmarks (never needed by the package).

``torchvision`` and ``timm`` are not requirements of actnn_zoo, and they are kept out of the
project's virtual environment: there, an installed torchvision whose compiled operators do not
load (its wheels are built against a CUDA torch) makes every ``import transformers`` fail. The
benchmarks install them into ``.bench_deps`` instead::

    .venv/bin/pip install --no-deps --target .bench_deps torchvision timm

and :func:`import_vision` puts that folder on ``sys.path``. torchvision's import then fails on
``operator torchvision::nms does not exist``; its model definitions (pure Python) work once the
two operator schemas its Python code registers fake kernels for are defined, which
:func:`import_vision` does once before importing it.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any, Optional, Tuple

import torch

BENCH_DEPS = Path(__file__).resolve().parents[1] / ".bench_deps"


@functools.lru_cache(maxsize=None)
def _schemas() -> Any:
    lib = torch.library.Library("torchvision", "DEF")  # kept alive by the cache
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    return lib


def import_vision() -> Tuple[Optional[Any], Optional[Any], str]:
    """(torchvision or None, timm or None, why any is missing)."""
    if BENCH_DEPS.is_dir() and str(BENCH_DEPS) not in sys.path:
        sys.path.append(str(BENCH_DEPS))
    why = []
    try:
        import torchvision  # noqa: F401
    except RuntimeError as exc:
        if "torchvision::nms" not in str(exc):
            raise
        _schemas()
        for name in [m for m in sys.modules if m.startswith("torchvision")]:
            del sys.modules[name]
        import torchvision  # noqa: F811
    except ImportError as exc:
        torchvision = None
        why.append(f"torchvision: {exc}")
    try:
        import timm
    except ImportError as exc:
        timm = None
        why.append(f"timm: {exc}")
    return torchvision, timm, "; ".join(why)
