"""The CUDA sources compile (nvcc, compile only: no GPU and no CUDA build of torch needed).

CI has no GPU, so nothing else there reads cpp_ext/*.cu; a change to a header they share with
the CPU kernels (bf16.h, kernels.h) could break the CUDA build unnoticed until a GPU machine
builds the package. scripts/check_cuda_build.sh compiles each .cu file with the flags of a real
CUDA build of actnn_zoo._C, warnings as errors. Here only the device code, to PTX for one
architecture (PTX_ONLY=1, compute_90), two files at a time: every file includes torch's headers,
and the full compile (host code, SASS for sm_80 and sm_90) took 12 minutes on the 2-core CI
machine, the device pass alone about a third of that (the host side of the shared headers is
compiled by the CPU build anyway). Run the script without PTX_ONLY for the full check. Skipped
only where nvcc is not installed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    cuda_home = os.environ.get("CUDA_HOME")
    if found is None and cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        found = str(Path(cuda_home) / "bin" / "nvcc")
    return found


@pytest.mark.timeout(900)
@pytest.mark.skipif(_nvcc() is None, reason="nvcc is not installed")
def test_cuda_sources_compile(tmp_path):
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "cpp_ext").glob("*.cu"))
    assert sources, "no cpp_ext/*.cu found"
    env = dict(os.environ, NVCC=_nvcc(), ARCHS="90", JOBS="2", PTX_ONLY="1",
               OUT_DIR=str(tmp_path), CU_FILES=" ".join(sources), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "check_cuda_build.sh")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    for src in sources:
        ptx = tmp_path / (Path(src).stem + ".ptx")
        assert ptx.is_file() and ".entry" in ptx.read_text(), f"{src}: no kernel in the PTX"


def _cuda_include(nvcc: str) -> Path:
    """The CUDA toolkit's include folder, as scripts/check_cuda_build.sh finds it."""
    if os.environ.get("CUDA_HOME"):
        return Path(os.environ["CUDA_HOME"]) / "include"
    out = subprocess.run([nvcc, "-dryrun", "-c", "-x", "cu", "/dev/null", "-o", "/dev/null"],
                         capture_output=True, text=True).stderr
    for line in out.splitlines():
        if line.startswith("#$ TOP="):
            return Path(line.split("=", 1)[1]) / "include"
    return Path(nvcc).resolve().parents[1] / "include"


@pytest.mark.timeout(900)
@pytest.mark.skipif(_nvcc() is None, reason="nvcc is not installed")
def test_cuda_branches_of_the_host_sources_compile(tmp_path):
    """The host-compiled sources' ``#ifdef ACTNN_ZOO_CUDA`` branches (the CUDA entries'
    argument checks, the device dispatch), which the CPU build never compiles: g++
    -fsyntax-only with ACTNN_ZOO_CUDA defined, warnings as errors, two files at a time."""
    from torch.utils import cpp_extension as ce

    sources = sorted(p for p in (ROOT / "cpp_ext").glob("*.cpp")
                     if "ACTNN_ZOO_CUDA" in p.read_text())
    assert len(sources) >= 3, sources
    inc = [f for p in ce.include_paths() for f in ("-isystem", p)]
    if not (Path(ce.include_paths()[0]) / "c10/cuda/impl/cuda_cmake_macros.h").exists():
        stub = tmp_path / "c10/cuda/impl"
        stub.mkdir(parents=True)
        (stub / "cuda_cmake_macros.h").write_text(
            "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        inc += ["-isystem", str(tmp_path)]
    import sysconfig
    inc += ["-isystem", sysconfig.get_path("include"), "-isystem", str(_cuda_include(_nvcc()))]
    cmd = ["g++", "-fsyntax-only", "-std=c++20", "-fopenmp", "-Wall", "-Werror",
           "-DACTNN_ZOO_CUDA", "-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H",
           f"-I{ROOT / 'cpp_ext'}", *inc]
    failed = []
    for i in range(0, len(sources), 2):
        procs = [(src, subprocess.Popen(cmd + [str(src)], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True))
                 for src in sources[i:i + 2]]
        for src, proc in procs:
            out, _ = proc.communicate(timeout=600)
            if proc.returncode != 0:
                failed.append(f"{src.name}:\n{out[-3000:]}")
    assert not failed, "\n".join(failed)
