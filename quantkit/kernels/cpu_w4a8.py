"""W4 weights times int8 activations on x86 CPUs with AVX2: the CPU path that makes a W4 model decode faster
than float16 where torch's packed int4 op does not (cpu_w4a8.cpp says why).

Each activation row is quantised to int8 per block of 32 inputs (one float scale per block, amax / 127) inside
the op, and the products run on bytes. The error that adds: each activation moves by at most half a step
(amax / 254) of its block of 32, so an outlier channel costs precision to 31 neighbours only (with one scale per
group of 128, a 20x outlier put random products 2% off); tests/test_cpu_w4a8.py holds the op to that bound. Like
every path it must pass linear/path_candidates.py's float64 check on the model's own weights before it is used.

The library is compiled once per machine with the system's C++ compiler against the installed torch (about ten
seconds; no ninja, no Python build step) and kept under quantkit's cache folder, keyed by the source and the
torch version. Where there is no compiler, no AVX2 (or torch is capped below it: ATEN_CPU_CAPABILITY=default),
or the build fails, the path is simply not a candidate, and the reason is logged once.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cache_dir import cache_root
from ..formats.pack import unpack_int32
from .cpu import group_runs, weight_buffer
from .reference import unpack_zero_points

log = logging.getLogger("quantkit.kernels")

SOURCE = Path(__file__).with_name("cpu_w4a8.cpp")
MAX_ROWS = 8  # byte products up to this many rows; past them one dequantisation and a float GEMM
_OP = "quantkit_cpu::w4a8_matmul"


@dataclass
class W4A8Pack:
    codes: torch.Tensor  # uint8 [N, K/2], cpu_w4a8.cpp's block layout
    scale: torch.Tensor  # float32 [N, G]
    zero: torch.Tensor  # uint8 [N, G] unsigned zero codes, or an empty tensor (symmetric: 8)
    group: int
    perm: torch.Tensor | None  # input order a g_idx with contiguous groups needs (x[:, perm])


def _library_path() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + sys.version.encode()).hexdigest()[:16]
    return cache_root() / f"cpu-w4a8-{key}" / "libquantkit_cpu_w4a8.so"


def _compile(out: Path) -> None:
    """g++ the one source file against torch's headers and libraries into OUT (built beside it, then renamed,
    so a concurrent or killed build never leaves a half-written library)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        target = Path(tmp) / out.name
        cmd = [cxx, "-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
               f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *[f"-I{p}" for p in include_paths()], str(SOURCE),
               *[f"-L{p}" for p in library_paths()], "-lc10", "-ltorch_cpu", "-o", str(target)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed: {p.stderr.strip()[-500:]}")
        os.replace(target, out)


def cpu_supported() -> bool:
    """AVX2 and FMA, as torch itself would use them: a cap below AVX2 (ATEN_CPU_CAPABILITY=default) says the
    CPU is treated as one without them."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether the op is loaded in this process (building it on first use); False, logged once, otherwise."""
    if not cpu_supported():
        log.info("cpu-w4a8 not available: torch runs this CPU at %s, below AVX2",
                 torch.backends.cpu.get_cpu_capability())
        return False
    try:
        lib = _library_path()
        if not lib.exists():
            _compile(lib)
        torch.ops.load_library(str(lib))
    except (RuntimeError, OSError) as e:
        log.info("cpu-w4a8 not available: %s", e)
        return False
    torch.library.register_fake(_OP)(_fake)
    torch.library.register_fake("quantkit_cpu::w4a8_dequant_out")(_fake_dequant)
    return True


def _fake(x, wq, ws, wz, group):
    return x.new_empty(x.shape[0], wq.shape[0], dtype=torch.float32)


def _fake_dequant(wq, ws, wz, group, out):
    return None


def repack(weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_zero_point: torch.Tensor | None,
           g_idx: torch.Tensor | None, group_size: int, in_features: int) -> W4A8Pack | None:
    """The op's layout of a 4-bit compressed-tensors weight; None where it does not apply (K or the group not a
    multiple of 32, a g_idx whose groups are not contiguous runs)."""
    n, k = weight_packed.shape[0], in_features
    groups = weight_scale.shape[1] if weight_scale.dim() == 2 else 1
    runs = group_runs(weight_scale, g_idx, group_size, k)
    if runs is None or runs[0] % 32:
        return None
    width, perm = runs
    u = (unpack_int32(weight_packed, 4, k).to(torch.int16) + 8).to(torch.uint8)
    if perm is not None:
        u = u[:, perm]
    blocks = u.reshape(n, k // 32, 2, 16)
    codes = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    zero = torch.empty(0, dtype=torch.uint8)
    if weight_zero_point is not None:
        zero = (unpack_zero_points(weight_zero_point, 4, n).to(torch.int16) + 8).to(torch.uint8)
        zero = zero.reshape(n, groups).contiguous()
    return W4A8Pack(codes, weight_scale.float().reshape(n, groups).contiguous(), zero, width, perm)


def matmul(pack: W4A8Pack, x2: torch.Tensor) -> torch.Tensor:
    """x2 [M, K] (any float dtype) times the packed weight: [M, N] float32. Up to MAX_ROWS rows the op's byte
    products; more rows (a prefill, a batch of sequences) multiply the dequantised float32 weight (exact codes
    and scales, float activations) in a reused buffer."""
    if pack.perm is not None:
        x2 = x2[:, pack.perm]
    if x2.shape[0] <= MAX_ROWS:
        return torch.ops.quantkit_cpu.w4a8_matmul(x2, pack.codes, pack.scale, pack.zero, pack.group)
    n, k = pack.codes.shape[0], pack.codes.shape[1] * 2
    w = weight_buffer(n, k, torch.float32, x2.device)
    torch.ops.quantkit_cpu.w4a8_dequant_out(pack.codes, pack.scale, pack.zero, pack.group, w)
    return x2.float() @ w.t()
