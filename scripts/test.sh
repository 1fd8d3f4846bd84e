#!/usr/bin/env bash
# Sets up .venv (CPU torch 2.13.0, the package and its C++ kernels) and runs the test suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@" tests
