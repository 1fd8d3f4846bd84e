"""The compiled extension for tests: skip without it on a developer machine, fail in CI.

CI (``CI=true``) builds the extension in scripts/setup_env.sh; a build that is missing there,
or one that lacks a kernel a test needs, must fail the run rather than let the parity and
kernel tests skip silently.
"""
from __future__ import annotations

import os
from types import ModuleType

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def skip_or_fail(message: str) -> None:
    """pytest.skip with ``message`` on a developer machine; pytest.fail under CI, where every
    skip for something missing would hide a gap."""
    if in_ci():
        pytest.fail(f"{message} (a skip is not allowed under CI=true)", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def compiled_extension(*needed: str) -> ModuleType:
    """``actnn_zoo._C``, which must have the functions named in ``needed``; otherwise
    pytest.skip (or, in CI, pytest.fail) saying what is missing."""
    try:
        from actnn_zoo import _C
    except ImportError as exc:
        skip_or_fail(f"compiled extension actnn_zoo._C is not built ({exc}); CI must build it "
                     "(scripts/setup_env.sh)")
    missing = [name for name in needed if not hasattr(_C, name)]
    if missing:
        skip_or_fail(f"this build of actnn_zoo._C lacks {', '.join(missing)}: rebuild it "
                     "(scripts/setup_env.sh)")
    return _C
