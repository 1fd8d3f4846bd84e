"""Which kernels run: the compiled extension, else a just-in-time build, else the reference.

Like bitsandbytes' backend dispatch, the choice is made once per process and per device type and
is cached (a loaded library, not configuration). ``ACTNN_ZOO_BACKEND=reference`` forces the
pure-torch kernels, e.g. to compare them with the compiled ones.
"""
from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from types import ModuleType
from typing import Optional, Union

import torch

from . import reference

_SOURCES = Path(__file__).resolve().parents[2] / "cpp_ext"
CPU_SOURCES = ("quant_cpu.cpp", "widths_cpu.cpp", "bindings.cpp", "hadamard_cpu.cpp",
               "division_cpu.cpp", "pack_compare_cpu.cpp", "sparse_cpu.cpp", "norm_cpu.cpp",
               "variance_cpu.cpp", "attention_dropout_cpu.cpp", "qlayers.cpp", "loss_cpu.cpp",
               "stacks.cpp")
CUDA_SOURCES = ("quant_cuda.cu", "hadamard_cuda.cu", "division_cuda.cu", "pack_compare_cuda.cu",
                "variance_cuda.cu", "attention_dropout_cuda.cu", "widths_cuda.cu")
# Portable by default: -march=native in a wheel or a shared JIT cache dies with SIGILL on an
# older CPU. ACTNN_ZOO_NATIVE=1 opts in (setup.py reads the same variable); the kernels are
# memory-bound and the portable build measured within noise of native (README, "Kernels").
NATIVE = os.environ.get("ACTNN_ZOO_NATIVE", "0") == "1"
CXX_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"] + (["-march=native"] if NATIVE else [])
NVCC_FLAGS = ["-O3", "--fmad=false"]
LD_FLAGS = ["-fopenmp"]


def _jit_build() -> ModuleType:
    from torch.utils.cpp_extension import load

    sources = [str(_SOURCES / s) for s in CPU_SOURCES]
    cuda = torch.cuda.is_available() and all((_SOURCES / s).exists() for s in CUDA_SOURCES)
    extra = {}
    if cuda:
        sources += [str(_SOURCES / s) for s in CUDA_SOURCES]
        extra = {"extra_cuda_cflags": NVCC_FLAGS + ["-DACTNN_ZOO_CUDA"]}
    cflags = CXX_FLAGS + (["-DACTNN_ZOO_CUDA"] if cuda else [])
    return load(name="actnn_zoo_C_native" if NATIVE else "actnn_zoo_C", sources=sources,
                extra_cflags=cflags, extra_ldflags=LD_FLAGS, verbose=False, **extra)


@functools.lru_cache(maxsize=None)
def extension() -> Optional[ModuleType]:
    """The compiled kernels, or None (with one warning saying why) when none can be had."""
    if os.environ.get("ACTNN_ZOO_BACKEND", "") == "reference":
        return None
    try:
        from actnn_zoo import _C  # built by setup.py

        return _C
    except ImportError as installed_error:
        reason = f"no prebuilt extension ({installed_error})"
    if all((_SOURCES / s).exists() for s in CPU_SOURCES):
        try:
            return _jit_build()
        except Exception as jit_error:  # a compiler or ninja missing, a build error
            reason += f"; just-in-time build failed ({type(jit_error).__name__}: {jit_error})"
    else:
        reason += f"; sources not found under {_SOURCES}"
    warnings.warn(f"actnn_zoo: using the slow pure-torch reference kernels: {reason}",
                  RuntimeWarning, stacklevel=2)
    return None


def kernels(device: Union[torch.device, str]) -> ModuleType:
    """The module whose quantize/dequantize/pack_mask/unpack_mask run on ``device``."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return _kernels_for(kind)


@functools.lru_cache(maxsize=None)
def _kernels_for(kind: str) -> ModuleType:
    """Per device type, cached like :func:`extension` (a loaded library, not configuration):
    every Q-layer call asks, so the answer is one dict lookup after the first. The meta device
    gets shape-only kernels (:mod:`actnn_zoo.quant.meta`): the CUDA path, nothing computed."""
    if kind == "meta":
        from . import meta

        return meta
    ext = extension()
    if ext is None:
        return reference
    if kind == "cuda" and not getattr(ext, "has_cuda", False):
        return reference
    return ext


def backend_name() -> str:
    """"cuda", "cpp" or "reference": what runs on the best device of this machine.

    "reference" means the compiled extension did not load and the slow pure-torch kernels
    run (same results, much slower): check this first when training is unexpectedly slow."""
    ext = extension()
    if ext is None:
        return "reference"
    if torch.cuda.is_available() and getattr(ext, "has_cuda", False):
        return "cuda"
    return "cpp"
