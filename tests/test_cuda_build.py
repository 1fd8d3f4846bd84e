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
