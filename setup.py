"""Builds actnn_zoo and its kernels (actnn_zoo._C): C++/OpenMP always, CUDA when torch has it."""
import os

from setuptools import find_packages, setup

import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

# Portable unless ACTNN_ZOO_NATIVE=1 (a -march=native build dies with SIGILL on an older CPU);
# actnn_zoo/quant/backend.py uses the same rule for just-in-time builds.
CXX_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
if os.environ.get("ACTNN_ZOO_NATIVE", "0") == "1":
    CXX_FLAGS.append("-march=native")
NVCC_FLAGS = ["-O3", "--fmad=false"]
cpu_sources = ["cpp_ext/quant_cpu.cpp", "cpp_ext/widths_cpu.cpp",
               "cpp_ext/bindings.cpp"]
cuda_sources = ["cpp_ext/quant_cuda.cu"]
cpu_sources += ["cpp_ext/hadamard_cpu.cpp"]
cuda_sources += ["cpp_ext/hadamard_cuda.cu"]
cpu_sources += ["cpp_ext/division_cpu.cpp"]
cuda_sources += ["cpp_ext/division_cuda.cu"]
cpu_sources += ["cpp_ext/pack_compare_cpu.cpp"]
cpu_sources += ["cpp_ext/sparse_cpu.cpp"]
cpu_sources += ["cpp_ext/norm_cpu.cpp"]
cpu_sources += ["cpp_ext/variance_cpu.cpp"]
cpu_sources += ["cpp_ext/attention_dropout_cpu.cpp"]
cpu_sources += ["cpp_ext/qlayers.cpp"]
cpu_sources += ["cpp_ext/stacks.cpp"]
cpu_sources += ["cpp_ext/loss_cpu.cpp"]
cuda_sources += ["cpp_ext/pack_compare_cuda.cu"]
cuda_sources += ["cpp_ext/variance_cuda.cu"]
cuda_sources += ["cpp_ext/attention_dropout_cuda.cu"]
cuda_sources += ["cpp_ext/widths_cuda.cu"]

# torch.get_autocast_dtype(device_type) needs 2.4. The compiled extension runs only with the
# torch minor version it was built against, so that is what the package requires.
MIN_TORCH = (2, 4)
TORCH_MINOR = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
if TORCH_MINOR < MIN_TORCH:
    raise RuntimeError(f"actnn_zoo needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}; this build "
                       f"found torch {torch.__version__}")
TORCH_REQUIREMENT = f"torch=={TORCH_MINOR[0]}.{TORCH_MINOR[1]}.*"

with_cuda = (torch.version.cuda is not None and CUDA_HOME is not None
             and all(os.path.exists(s) for s in cuda_sources)
             and os.environ.get("ACTNN_ZOO_NO_CUDA", "0") != "1")
if with_cuda:
    ext = CUDAExtension(
        "actnn_zoo._C", cpu_sources + cuda_sources,
        extra_compile_args={"cxx": CXX_FLAGS + ["-DACTNN_ZOO_CUDA"],
                            "nvcc": NVCC_FLAGS + ["-DACTNN_ZOO_CUDA"]},
        extra_link_args=["-fopenmp"])
else:
    ext = CppExtension("actnn_zoo._C", cpu_sources, extra_compile_args=CXX_FLAGS,
                       extra_link_args=["-fopenmp"])

setup(
    name="actnn_zoo",
    version="0.1.0",
    description="Activation-compressed training for PyTorch: quantized drop-in layers",
    packages=find_packages(include=["actnn_zoo", "actnn_zoo.*"]),
    # The shipped configs install with the package, so convert_model(model, "4bit") works
    # outside a clone (actnn_zoo.config.shipped_configs); configs/ at the top of the
    # repository is a link to this folder.
    package_data={"actnn_zoo": ["configs/*.yaml"]},
    python_requires=">=3.9",
    install_requires=[TORCH_REQUIREMENT, "pyyaml"],
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
