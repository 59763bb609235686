"""Memory figures: bytes of weights, peak memory while a model runs, KV-cache bytes per token."""
from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

from ..devices import proc_kib


def checkpoint_bytes(folder: Path) -> int:
    """Bytes of the safetensors files: what the weights cost on disk and, for our runtime, in memory."""
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def module_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t is None or t.data_ptr() in seen:  # tied embeddings share storage
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def kv_bytes_per_token(config: dict, dtype_bytes: int) -> int:
    """2 (K and V) x layers x KV heads x head dim x bytes; an FP8 kv_cache_scheme stores one byte each."""
    from .estimate import kv_bytes_per_token as kv, shape_from_config

    qc = config.get("quantization_config") or {}
    if (qc.get("kv_cache_scheme") or {}).get("num_bits") == 8:
        dtype_bytes = 1
    return kv(shape_from_config(config), dtype_bytes)


def config_of(folder: Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


class PeakMemory:
    """Peak memory between reset() and read(): CUDA allocator peak on a GPU, process peak RSS on the CPU.

    On Linux, writing 5 to /proc/self/clear_refs resets the kernel's high-water mark (VmHWM) so each model
    gets its own peak; elsewhere the lifetime peak (ru_maxrss) is all there is, which only ever grows.
    """

    def __init__(self, device: str):
        self.cuda = str(device).startswith("cuda")
        self.kind = "cuda_max_allocated" if self.cuda else "process_peak_rss"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.kind = "process_peak_rss"
        except OSError:
            self.kind = "process_lifetime_peak_rss"

    def read(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return int(torch.cuda.max_memory_allocated())
        hwm = proc_kib("/proc/self/status", "VmHWM")
        if hwm is not None:
            return hwm
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB
