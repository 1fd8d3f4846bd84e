#!/usr/bin/env bash
# Creates .venv (once) with the CPU build of torch 2.13.0 and the package built in place.
# Sourced by test.sh and demo.sh; safe to run again (it only installs what is missing).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first and alone, pinned: nothing later may pull a CUDA build.
if ! "$VPY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  "$VPY" -m pip install -q "torch==2.13.0"
fi
"$VPY" -m pip install -q -r requirements-dev.txt "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
# Build the C++ extension in place (rebuilds only when sources changed).
if ! "$VPY" -c "import actnn_zoo._C" 2>/dev/null || [ -n "$(find cpp_ext setup.py -newer .venv/.az_built 2>/dev/null)" ] || [ ! -f .venv/.az_built ]; then
  "$VPY" -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v "^WARNING: Location" || true
  "$VPY" -c "import actnn_zoo._C" && touch .venv/.az_built
fi
