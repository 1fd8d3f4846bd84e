#!/usr/bin/env bash
# Every GPU measurement in one call (about 9 minutes on an H200, the build 95 s of it): build actnn_zoo._C against
# this machine's own PyTorch, run the CUDA tests, time the kernels, measure ResNet-50 and GPT-2.
#
#   bash scripts/gpu_report.sh [OUTDIR]              # default OUTDIR: results/gpu
#   PHASES="build cuda_tests" bash scripts/gpu_report.sh /tmp/out
#   PHASES="build suite" bash scripts/gpu_report.sh  # the whole test suite on the GPU machine
#
# Phases (PHASES, in this order): build, cuda_tests (tests/test_cuda.py and every other test
# whose name says cuda or sync, 8 processes), kernels (stochastic, then nearest rounding; the
# lean quantize kernel beside the default),
# profile (Nsight Compute on one quantize launch; not by default), models, step_profile
# (torch.profiler's self CPU time per op of a GPT-2 and a ResNet-50 step; not by default), compiled
# (torch.compile of the plain model, actnn_zoo.compile of the default and torch.compile of the
# default, step time and peak, no largest batch), suite (not by default).
# Each phase runs under its own time limit and writes one file into OUTDIR, so that a phase
# that fails or runs out of time still leaves the others' results; summary.txt says how each
# ended. TOTAL_SECONDS (default 570) bounds the whole run: a phase gets at most what is left.
# At most eight files are written by default (eleven with profile, step_profile and suite:
# the device tool returns eight, so name fewer phases in one call).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUTDIR="$(mkdir -p "${1:-results/gpu}" && cd "${1:-results/gpu}" && pwd)"
PY="${PYTHON:-python3}"
PHASES="${PHASES:-build cuda_tests kernels models compiled}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-16}" PYTHONUNBUFFERED=1
DEADLINE=$((SECONDS + ${TOTAL_SECONDS:-570}))  # every phase ends before this
SUMMARY="$OUTDIR/summary.txt"
: > "$SUMMARY"

note() { echo "== $(date +%T) $*" | tee -a "$SUMMARY"; }
run_phase() {  # name, seconds, log file, command...
  local name="$1" limit="$2" logf="$3"; shift 3
  case " $PHASES " in *" $name "*) ;; *) return 0 ;; esac
  local left=$((DEADLINE - SECONDS - 5))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 10 ]; then note "$name: SKIPPED, no time left"; return 1; fi
  note "$name: start (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUTDIR/$logf" 2>&1
  local rc=$?
  note "$name: exit $rc after $((SECONDS - t0))s ($logf)"
  tail -n 25 "$OUTDIR/$logf"
  return $rc
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
  nvcc --version | tail -n 2 || true
} >> "$SUMMARY" 2>&1
cat "$SUMMARY"

run_phase build 420 build.log \
  bash -c "{ '$PY' -m pip install --no-build-isolation --no-deps -v -e . || { echo 'pip install -e failed: building in place instead'; '$PY' setup.py build_ext --inplace; }; } && '$PY' -c 'import actnn_zoo._C as C, actnn_zoo as az; assert C.has_cuda, \"built without CUDA\"; print(\"backend:\", az.backend_name())'" \
  || note "build FAILED: the phases below use whatever backend loads"

CUDA_TEST_FILES=(tests/test_cuda.py tests/test_sync_free.py tests/test_attention.py
  tests/test_loss.py tests/test_division.py tests/test_pack_compare.py tests/test_capture_hooks.py
  tests/test_kernels.py)
run_phase cuda_tests 360 test_cuda.log \
  "$PY" -m pytest -q -p no:cacheprovider -rfEs -n "${TEST_PROCS:-8}" "${CUDA_TEST_FILES[@]}" \
  -k "cuda or Cuda or sync"

run_phase kernels 150 kernels.log \
  bash -c "'$PY' scripts/bench_cuda.py --gib 1 --bits 1 2 4 8 --repeats 20 --lean --json '$OUTDIR/kernels.json' && '$PY' scripts/bench_cuda.py --gib 1 --bits 2 8 --repeats 20 --nearest --lean"

# One stochastic 2-bit quantize launch of 256 MiB (the fourth, after warm-up), every section of
# Nsight Compute's detailed set, clocks left alone; the general kernel, then the lean one.
NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1 || true)"
run_phase profile 150 profile.log \
  bash -c "[ -n '$NCU' ] || { echo 'no ncu on this machine'; exit 3; }; for k in quantize_kernel quantize_lean_kernel; do '$NCU' --clock-control none --set detailed --kernel-name regex:\$k --launch-skip 3 --launch-count 1 '$PY' scripts/bench_cuda.py --gib 0.25 --bits 2 --repeats 1 --warmup 3 --lean || exit; done"

run_phase models 480 models.log \
  "$PY" scripts/bench_gpu_models.py --json "$OUTDIR/models.json"

# Where a step's host time goes (torch.profiler, self CPU time per op, fp32 against the
# converted modes), GPT-2 small at batch 4 and ResNet-50 at batch 64: on the H200 run of
# 2026-11-30 the converted steps ran 8-13x fp32's, and nothing measured there said why.
run_phase step_profile 300 step_profile.log \
  bash -c "'$PY' scripts/profile_step.py --models gpt2 --batch 4 --modes fp32 '2-bit uniform' '2-bit default' --steps 2 --warmup 3 --rows 40 && '$PY' scripts/profile_step.py --models resnet50 --batch 64 --modes fp32 '2-bit default' --steps 2 --warmup 3 --rows 40"

run_phase compiled 300 compiled.log \
  "$PY" scripts/bench_gpu_models.py --modes fp32 "compiled fp32" "compiled default" \
  "torch.compile default" \
  --no-max-batch

run_phase suite 480 suite.log \
  "$PY" -m pytest -q -p no:cacheprovider -rfE -n "${SUITE_PROCS:-14}" tests --ignore=tests/test_cuda.py

note "done"
