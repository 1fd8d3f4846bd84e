#!/usr/bin/env bash
# Runs the test suite against another torch release, on the CPU, without touching the
# project's .venv or its compiled extension.
#
#   bash scripts/test_torch_version.sh 2.11.0                # the whole suite
#   bash scripts/test_torch_version.sh 2.11.0 -k capture     # pytest arguments after it
#
# Why: the package claims torch >= 2.4 and CI runs only 2.13. Behaviour that differs between
# releases (who owns a custom Function's node, what torch.compiler.is_compiling() says
# inside AOTAutograd's hook tracing, dynamo's handling of aliases) broke three things on the
# GPU machine's torch 2.11 that 2.13 never showed (docs/results.md, "Other torch releases").
#
# What it does: a venv at .venv-torch-<version> (or $VENV) with that torch from PyPI (on
# Linux x86_64 a CUDA build, ~4.5 GB with its nvidia packages; it runs on the CPU) and the
# test dependencies of requirements-dev.txt resolved against it; a copy of the committed tree
# (git archive HEAD, plus the working tree's changes to tracked files) under
# build/torch-<version>, where the extension is built for the CPU only (ACTNN_ZOO_NO_CUDA=1;
# ~6 min on 2 cores). Not part of CI: CI must not download a CUDA build of torch.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="${1:?usage: bash scripts/test_torch_version.sh <torch version> [pytest args]}"
shift
VENV="${VENV:-$ROOT/.venv-torch-$VERSION}"
TREE="$ROOT/build/torch-$VERSION"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torch, sys; \
        sys.exit(torch.__version__.split('+')[0] != '$VERSION')" 2>/dev/null; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q "torch==$VERSION" -r "$ROOT/requirements-dev.txt" scipy
fi

rm -rf "$TREE"
mkdir -p "$TREE"
git -C "$ROOT" archive HEAD | tar -x -C "$TREE"
# uncommitted edits to tracked files travel too (new files must be committed first)
PATCH="$(git -C "$ROOT" diff HEAD --binary)"
if [ -n "$PATCH" ]; then
    printf '%s\n' "$PATCH" | (cd "$TREE" && git apply)
fi
(cd "$TREE" && ACTNN_ZOO_NO_CUDA=1 MAX_JOBS="${MAX_JOBS:-2}" \
    "$VENV/bin/python" setup.py -q build_ext --inplace > build.log 2>&1) \
    || { tail -30 "$TREE/build.log"; exit 1; }
cd "$TREE"
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    --deselect tests/test_packaging.py::test_isolated_build_pins_the_torch_the_tests_run_with \
    "$@" tests
