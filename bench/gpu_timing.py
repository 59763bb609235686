"""Kernel timing on a GPU that measures the kernel, not Python: shared by bench/kernels_gpu.py and bench/fp8_gpu.py.

- Launch overhead: timing one Python call between two CUDA events measures the launch (several us) as much as
  a 10 us kernel. Here a CUDA graph holds `launches` back-to-back calls and the graph's replay is timed, divided
  by the launches; where capture fails the same calls run back to back without a graph (still one pair of
  events around all of them), and the row says so.
- The L2 cache: H100/H200 hold 50 MB, so a 16-32 MB weight called twice in a row is served from L2 the second
  time. Each call here takes the next of enough weight copies that the pool is larger than twice the L2.
"""
from __future__ import annotations

import statistics
import sys

import torch

MIN_POOL_BYTES = 128 << 20  # more than 2x the 50 MB L2 of an H100/H200, whatever the device reports


def require_cuda(script: str, need: str = "a CUDA GPU") -> None:
    """One clear line and exit code 2 where there is nothing to time."""
    if not torch.cuda.is_available():
        print(f"{script} needs {need}; torch {torch.__version__} sees none (torch.cuda.is_available() is False), "
              "so nothing was timed", file=sys.stderr)
        sys.exit(2)


def pool_size(bytes_each: int) -> int:
    """Copies of a weight so that consecutive calls never find theirs in L2: pool > 2x L2, and at least two."""
    l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 50 << 20)
    return max(2, -(-max(MIN_POOL_BYTES, 2 * l2 + 1) // max(1, bytes_each)))


def rotating(tensors: list, copies: int) -> list:
    """`copies` independent copies of a group of tensors (the first is the originals)."""
    return [tuple(tensors)] + [tuple(t.clone() for t in tensors) for _ in range(copies - 1)]


def time_us(call, copies: int, launches: int = 200, repeats: int = 5) -> tuple[float, str]:
    """Median microseconds per launch of call(i) for i = 0.. launches-1 (call(i) uses copy i % copies).
    Returns (us, mode) with mode 'graph' or 'back-to-back'."""
    for i in range(min(copies, 3)):  # compile (Triton), autotune and allocate outside the timing
        call(i)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(launches):
                call(i)
        run, mode = graph.replay, "graph"
    except Exception:  # noqa: BLE001 - anything not capturable is timed without the graph
        torch.cuda.synchronize()

        def run():
            for i in range(launches):
                call(i)

        mode = "back-to-back"
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / launches)
    return statistics.median(times), mode


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy of nbytes, counted as read + write, in GB/s: the bandwidth kernels are held to."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us, _ = time_us(lambda i: b.copy_(a), 1, launches=10, repeats=5)
    return 2 * nbytes / (us * 1e-6) / 1e9
