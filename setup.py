"""Build script.

Pure Python by default. The CUDA extension `primerl._C` (sources in csrc/) is built only where a
CUDA build of torch and nvcc exist, or when PRIMERL_BUILD_CUDA=1 forces it. Build it with
`pip install --no-build-isolation .` so the build sees the installed CUDA torch.
"""
import glob
import os
import shutil
import sys

from setuptools import setup


def _want_cuda_extension():
    forced = os.environ.get("PRIMERL_BUILD_CUDA")
    if forced == "0":
        return False, "PRIMERL_BUILD_CUDA=0"
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:
        if forced == "1":
            sys.exit("PRIMERL_BUILD_CUDA=1 but torch is not importable in the build environment "
                     "(use pip install --no-build-isolation)")
        return False, "torch is not importable in the build environment"
    if forced == "1":
        return True, "PRIMERL_BUILD_CUDA=1"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU build"
    if CUDA_HOME is None and shutil.which("nvcc") is None:
        return False, "nvcc not found"
    return True, f"CUDA torch {torch.__version__} and nvcc found"


def _extensions():
    build, why = _want_cuda_extension()
    if not build:
        print(f"primerl: installing as pure Python ({why}); the CUDA backend will be unavailable")
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    print(f"primerl: building the CUDA extension primerl._C ({why})")
    root = os.path.dirname(os.path.abspath(__file__))
    sources = sorted(glob.glob("csrc/**/*.cu", recursive=True) + glob.glob("csrc/**/*.cpp", recursive=True))
    arch = os.environ.get("PRIMERL_CUDA_ARCH", "90a")
    ext = CUDAExtension(
        name="primerl._C",
        sources=sources,
        include_dirs=[os.path.join(root, "csrc")],
        extra_compile_args={
            "cxx": ["-O3", "-std=c++17"],
            "nvcc": ["-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}"],
        },
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
