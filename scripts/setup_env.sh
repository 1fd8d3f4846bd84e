#!/usr/bin/env bash
# Creates .venv (once) with the CPU build of torch 2.13.0 and the package built in place.
# Sourced by test.sh and demo.sh; safe to run again (it only installs what is missing).
#
# torch: the CPU build is asked for explicitly from PyTorch's CPU package index when that index
# is reachable; where it is not (an offline mirror, a machine whose pip finds a local CPU wheel
# first), the plain `pip install torch==2.13.0` is used. Nothing later may pull a CUDA build:
# torch is installed first and alone, and later installs are pinned to it.
# A failed build of the C++ extension fails this script (and so CI): no silent fallback.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
CPU_INDEX="${ACTNN_ZOO_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
quiet() { { grep -v "^WARNING: Location" || true; }; }  # keeps pip's exit status (pipefail)

if ! "$VPY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  if "$VPY" - "$CPU_INDEX" <<'EOF' 2>/dev/null; then
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10)
EOF
    echo "setup_env: installing torch $TORCH_VERSION (CPU build) from $CPU_INDEX"
    "$VPY" -m pip install -q --index-url "$CPU_INDEX" "torch==$TORCH_VERSION" 2>&1 | quiet
  else
    echo "setup_env: $CPU_INDEX not reachable; plain pip install torch==$TORCH_VERSION"
    "$VPY" -m pip install -q "torch==$TORCH_VERSION" 2>&1 | quiet
  fi
fi
"$VPY" -m pip install -q -r requirements-dev.txt "torch==$TORCH_VERSION" 2>&1 | quiet
# The third-party model zoos the README's mappings are tested against (tests/test_third_party.py,
# ...) go into .bench_deps, not the venv: torchvision's wheel does not load its compiled ops
# with the CPU torch, and an importable torchvision then breaks every `import transformers`
# (GPT-2 in actnn_zoo.models, the benchmarks). tests/conftest.py and
# scripts/third_party.py:import_vision put .bench_deps on sys.path after defining the two
# operator schemas torchvision's import needs. torchvision 0.28 pairs with torch 2.13.
VISION_PINS="torchvision==0.28.0 timm==1.0.31"
if [ "$(cat .bench_deps/.az_pins 2>/dev/null)" != "$VISION_PINS" ]; then
  "$VPY" -m pip install -q --no-deps --upgrade --target .bench_deps $VISION_PINS 2>&1 | quiet
  echo "$VISION_PINS" > .bench_deps/.az_pins
fi
if "$VPY" -m pip show -q torchvision >/dev/null 2>&1; then  # a venv from an earlier setup
  "$VPY" -m pip uninstall -q -y torchvision timm 2>&1 | quiet
fi
# Build the C++ extension in place (rebuilds only when sources changed).
if [ ! -f .venv/.az_built ] || [ -n "$(find cpp_ext setup.py pyproject.toml -newer .venv/.az_built 2>/dev/null)" ] \
    || ! "$VPY" -c "import actnn_zoo._C" 2>/dev/null; then
  rm -f .venv/.az_built
  "$VPY" -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | quiet
  "$VPY" -c "import actnn_zoo._C" || { echo "setup_env: actnn_zoo._C does not import after the build" >&2; exit 1; }
  touch .venv/.az_built
fi
