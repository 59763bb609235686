"""Build check for the CUDA C++ kernels: every .cu compiles for sm_90 with warnings as errors, the torch binding
compiles against this torch's headers, and importing the loader without a GPU says why it cannot run."""
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

import quantkit.kernels

CUDA_DIR = Path(quantkit.kernels.__file__).parent / "cuda"
CU_FILES = sorted(CUDA_DIR.glob("*.cu"))


def _nvcc() -> str:
    found = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)
    assert found, "nvcc not found on PATH or at /usr/local/cuda/bin/nvcc; the CUDA build check needs it"
    return found


def test_cuda_sources_exist():
    assert {p.name for p in CU_FILES} >= {"dequant.cu", "gemv_w4a16.cu", "gemm_w4a16_tc.cu"}


@pytest.mark.parametrize("source", CU_FILES, ids=lambda p: p.name)
def test_cu_compiles_for_sm90_without_warnings(source, tmp_path):
    cmd = [_nvcc(), "-arch=sm_90", "-c", str(source), "-o", str(tmp_path / "out.o"), "-Werror", "all-warnings",
           "-Xcompiler", "-Wall,-Wextra,-Werror", "-I", str(CUDA_DIR)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stdout}\n{res.stderr}"
    # nvcc passes some diagnostics through without failing; any text on stderr is a warning we refuse
    assert not res.stderr.strip(), res.stderr


def _cuda_include() -> Path:
    from torch.utils.cpp_extension import CUDA_HOME

    homes = [os.environ.get("CUDA_HOME"), CUDA_HOME, "/usr/local/cuda"]
    found = next((Path(h, "include") for h in homes if h and Path(h, "include", "cuda_runtime_api.h").exists()), None)
    assert found, f"no CUDA headers (include/cuda_runtime_api.h) under {homes}; set CUDA_HOME"
    return found


def test_binding_compiles_against_torch_headers(tmp_path):
    from torch.utils.cpp_extension import include_paths

    incs = [*include_paths(), sysconfig.get_paths()["include"], str(_cuda_include())]
    # a CPU build of torch ships c10/cuda's headers without the one CMake generates; stand in for it
    if not any(Path(p, "c10/cuda/impl/cuda_cmake_macros.h").exists() for p in incs):
        stub = tmp_path / "c10" / "cuda" / "impl"
        stub.mkdir(parents=True)
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        incs.append(str(tmp_path))
    cmd = ["g++", "-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
           *[a for p in incs for a in ("-isystem", p)], str(CUDA_DIR / "binding.cpp")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]


def test_import_explains_when_there_is_no_gpu():
    res = subprocess.run([sys.executable, "-c", "import quantkit.kernels.cuda"], capture_output=True, text=True)
    if torch.cuda.is_available():  # GPU machines import it (the JIT build happens on first use, not here)
        assert res.returncode == 0, res.stderr
    else:
        assert res.returncode != 0 and "needs a CUDA GPU" in res.stderr, res.stderr
