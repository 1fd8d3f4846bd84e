#!/usr/bin/env bash
# Compiles each cpp_ext/*.cu to an object file (no link) for sm_80 and sm_90 with the flags a
# real CUDA build of actnn_zoo._C uses (torch.utils.cpp_extension's nvcc flags + setup.py's), so a
# machine with nvcc but without a GPU or a CUDA build of torch can prove the CUDA code compiles.
#
#   scripts/check_cuda_build.sh            # uses .venv/bin/python (or $PYTHON) and nvcc on PATH
#   NVCC=/usr/local/cuda/bin/nvcc ARCHS="80 90" scripts/check_cuda_build.sh
#   WERROR=0 NVCC_EXTRA="-Xptxas=-v" scripts/check_cuda_build.sh   # warnings allowed; reg. usage
#   ARCHS=90 JOBS=2 scripts/check_cuda_build.sh      # one architecture, two files at a time
#   PTX_ONLY=1 ARCHS=90 JOBS=2 scripts/check_cuda_build.sh
#       device code only, to PTX (no host compile, no ptxas): about half the time, what
#       tests/test_cuda_build.py runs in CI (the host side of shared headers is compiled by
#       the CPU build anyway)
#
# Warnings (and register spills, via -Xptxas=-warn-spills) are errors unless WERROR=0.
#
# A CPU-only torch wheel ships the c10/cuda headers but not c10/cuda/impl/cuda_cmake_macros.h
# (generated at build time in CUDA wheels; it only defines C10_CUDA_BUILD_SHARED_LIBS); when it is
# missing, an equivalent stub is put on the include path.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
NVCC="${NVCC:-$(command -v nvcc || true)}"
if [ -z "$NVCC" ]; then
  if [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then NVCC="$CUDA_HOME/bin/nvcc"; fi
fi
if [ -z "$NVCC" ]; then
  echo "check_cuda_build: nvcc not found (set NVCC or CUDA_HOME)" >&2
  exit 2
fi
ARCHS="${ARCHS:-80 90}"
OUT_DIR="${OUT_DIR:-$ROOT/build/check_cuda}"
mkdir -p "$OUT_DIR"

# CUDA include dir: $CUDA_HOME/include, else next to the real nvcc binary (resolving wrappers).
NVCC_REAL="$("$NVCC" -dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=\(.*\)$/\1/p' | head -n1)"
if [ -n "${CUDA_HOME:-}" ]; then
  CUDA_INC="$CUDA_HOME/include"
elif [ -n "$NVCC_REAL" ] && [ -d "$NVCC_REAL/include" ]; then
  CUDA_INC="$NVCC_REAL/include"
else
  CUDA_INC="$(cd "$(dirname "$(readlink -f "$NVCC")")/.." && pwd)/include"
fi

# Everything torch would pass, read from torch itself.
mapfile -t TORCH_FLAGS < <("$PY" - <<'EOF'
import sysconfig
import torch
from torch.utils import cpp_extension as ce

for p in ce.include_paths():          # torch/include, torch/include/torch/csrc/api/include
    print("-isystem"); print(p)
py_inc = sysconfig.get_path("include", scheme="posix_prefix")
if py_inc:
    print("-isystem"); print(py_inc)
for f in ce.COMMON_NVCC_FLAGS:         # -D__CUDA_NO_HALF_OPERATORS__ ... --expt-relaxed-constexpr
    print(f)
print(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
EOF
)

EXTRA_INC=()
TORCH_INC="$("$PY" -c 'from torch.utils import cpp_extension as ce; print(ce.include_paths()[0])')"
if [ ! -f "$TORCH_INC/c10/cuda/impl/cuda_cmake_macros.h" ]; then
  STUB="$OUT_DIR/stub_include"
  mkdir -p "$STUB/c10/cuda/impl"
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$STUB/c10/cuda/impl/cuda_cmake_macros.h"
  EXTRA_INC=(-isystem "$STUB")
  echo "note: $TORCH_INC lacks c10/cuda/impl/cuda_cmake_macros.h (CPU wheel); using a stub"
fi

STRICT=(-Xptxas=-warn-spills -Werror=all-warnings)
[ "${WERROR:-1}" = 0 ] && STRICT=()

GENCODE=()
for a in $ARCHS; do GENCODE+=("-gencode=arch=compute_$a,code=sm_$a"); done
OUT_KIND=(-c)
EXT=o
if [ "${PTX_ONLY:-0}" = 1 ]; then
  set -- $ARCHS
  GENCODE=("-arch=compute_$1")
  OUT_KIND=(-ptx)
  EXT=ptx
  [ "${WERROR:-1}" = 0 ] || STRICT=(-Werror=all-warnings)
fi

"$NVCC" --version | tail -n 2
CUOBJDUMP="$(command -v cuobjdump || true)"
[ -z "$CUOBJDUMP" ] && [ -n "$NVCC_REAL" ] && [ -x "$NVCC_REAL/bin/cuobjdump" ] && CUOBJDUMP="$NVCC_REAL/bin/cuobjdump"
# Every CUDA source of the extension (CU_FILES overrides: a space-separated list of paths);
# JOBS files at a time (default 1; each nvcc run takes one core for minutes).
compile_one() {
  local CU="$1" OBJ
  OBJ="$OUT_DIR/$(basename "${CU%.cu}").$EXT"
  local CMD=("$NVCC" "${OUT_KIND[@]}" "$CU" -o "$OBJ"
       "-I$ROOT/cpp_ext" "${EXTRA_INC[@]}" -isystem "$CUDA_INC" "${TORCH_FLAGS[@]}"
       --compiler-options "-fPIC" -std=c++20
       -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H
       -O3 --fmad=false -DACTNN_ZOO_CUDA
       "${GENCODE[@]}" "${STRICT[@]}" ${NVCC_EXTRA:-})
  echo "+ ${CMD[*]}"
  "${CMD[@]}" || { echo "check_cuda_build: FAILED: $CU" >&2; return 1; }
  echo "check_cuda_build: OK: $OBJ ($(stat -c %s "$OBJ") bytes) for sm_${ARCHS// /, sm_}"
  if [ -n "$CUOBJDUMP" ] && [ "$EXT" = o ]; then
    "$CUOBJDUMP" --list-elf "$OBJ" || true
  fi
}
JOBS="${JOBS:-1}"
FAILED=0
PIDS=()
for CU in ${CU_FILES:-cpp_ext/*.cu}; do
  if [ "${#PIDS[@]}" -ge "$JOBS" ]; then
    wait "${PIDS[0]}" || FAILED=1
    PIDS=("${PIDS[@]:1}")
  fi
  compile_one "$CU" &
  PIDS+=($!)
done
for PID in "${PIDS[@]}"; do wait "$PID" || FAILED=1; done
exit "$FAILED"
