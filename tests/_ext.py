"""The compiled extension for tests: skip without it on a developer machine, fail in CI.

CI (``CI=true``) builds the extension in scripts/setup_env.sh; a build that is missing there
must fail the run rather than let the parity and kernel tests skip silently.
"""
from __future__ import annotations

import os
from types import ModuleType

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def compiled_extension() -> ModuleType:
    """``actnn_zoo._C``; pytest.skip (or, in CI, pytest.fail) with the import error."""
    try:
        from actnn_zoo import _C
    except ImportError as exc:
        message = f"compiled extension actnn_zoo._C is not built ({exc})"
        if in_ci():
            pytest.fail(f"{message}; CI must build it (scripts/setup_env.sh)", pytrace=False)
        pytest.skip(message, allow_module_level=True)
    return _C
