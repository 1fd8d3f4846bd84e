"""scripts/bench_host_instructions.py: its worker (the counted steps, without valgrind) and its
argument errors. The counting itself needs valgrind and minutes a mode; its output is in
docs/results.md."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from _scripts import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_host_instructions.py"


def test_the_worker_runs_the_steps_and_leaves_at_once():
    """The process valgrind counts: builds the CNN's default step, runs warm-up and counted
    steps around the getppid mark, and exits 0 through os._exit."""
    run = subprocess.run([sys.executable, str(SCRIPT), "--worker", "--models", "cnn",
                          "--modes", "default", "--warmup", "1", "--steps", "1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.parametrize("argv, message", [
    (["--models", "vgg"], "unknown model 'vgg'"),
    (["--modes", "fp32,fast"], "unknown mode 'fast'"),
    (["--steps", "0"], "--steps and --jobs must be >= 1"),
])
def test_bad_arguments_are_named(argv, message, capsys, monkeypatch):
    mod = load_script("bench_host_instructions.py")
    monkeypatch.setattr(mod.shutil, "which", lambda name: "/usr/bin/valgrind")
    with pytest.raises(SystemExit):
        mod.main(argv)
    assert message in capsys.readouterr().err


def test_split_counts_the_kernel_loops_and_nothing_else():
    """--split's attribution of callgrind_annotate's self costs: the extension's kernel files
    and whatever the task runners inline count as compression loops; its glue (bindings,
    autograd nodes, stacks), torch, Python and the whole-program lines do not."""
    mod = load_script("bench_host_instructions.py")
    annotated = "\n".join([
        "1,000,000 (100.0%)  ./Programs/python.c:main [/usr/bin/python3.11]",
        "    700  /work/main/cpp_ext/norm_cpu.cpp:void actnn_zoo::run_avx2<actnn_zoo::parallel_"
        "tasks<plane_sums(...)>> [/work/main/actnn_zoo/_C.so]",
        "     50  /work/main/cpp_ext/variance.h:void actnn_zoo::run_avx2<...> [_C.so]",
        "      5  /usr/include/c++/12/cmath:void actnn_zoo::run_avx2<actnn_zoo::parallel_tasks<"
        "variance_codes_impl<float, float>>> [_C.so]",
        "     30  /work/main/cpp_ext/sparse_cpu.cpp:actnn_zoo::dequantize_sparse_cpu(...) [_C.so]",
        "  4,000  /work/main/cpp_ext/bindings.cpp:pybind11 glue [_C.so]",
        "    900  /work/main/cpp_ext/qlayers.cpp:actnn_zoo::QConvFunction::backward [_C.so]",
        "    800  /work/main/.venv/torch/include/pybind11/pybind11.h:pybind11::cpp_function::"
        "dispatcher [/work/main/actnn_zoo/_C.so]",
        "  9,000  ???:mkl_blas_avx2_sgemm_kernel_0 [libtorch_cpu.so]",
        "  2,000  Python/ceval.c:_PyEval_EvalFrameDefault [libpython3.11.so.1.0]",
    ])
    assert mod.loop_instructions(annotated) == 700 + 50 + 5 + 30
