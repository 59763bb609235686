"""Freed memory handed back to the OS (glibc's malloc_trim; elsewhere nothing to do).

torch takes tensors larger than glibc's mmap threshold straight from the OS and gives them back when freed, but
glibc raises that threshold to the size of each such block freed (up to 32 MiB on 64-bit), so from then on
blocks of a layer's size come from the heap, and freed ones stay resident until trimmed: streaming a 1.4B llama
layer by layer, RSS grew by ~3.5 bytes per parameter instead of the 1 byte its kept codes take; sampling
16 x 256 tokens from SmolLM2-135M's W4 copy, by 476 MB against the 189 MB its KV cache holds. Pinning the
threshold instead (mallopt) cannot be undone, and a pinned run was either slower (1 MiB: AWQ's searches 60%
slower) or held more at its end (4 MiB: 559 MiB; 16 MiB: 1,112 MiB above a warmed process, SmolLM2 default
under --max-memory cpu=448MiB, 8 x 128 tokens, RssAnon read every millisecond; 2-core Intel Xeon, 2026-12-04).
Pinned at glibc's own 128 KiB the solving stage of that run peaked at 307 MiB, but the run took 135-138 s
against 70-77 s (2-core AMD EPYC, 2026-12-05). So the heap is trimmed where a layer's temporaries have just
been freed: per streamed layer, after each calibration pass (capture/layer.py), after each of AWQ's searches and
after each Linear's solve (GPTQ's float64 sums and factors: on three SmolLM2 layers, awq+gptq on 64 x 512 tokens
with the activations on disk, 182 -> 153 MiB above the loaded model in the same 44 s; a trim per calibration
sample gave 142 MiB but 54 s); the solving stage then peaked at 371 MiB against 395-444 MiB with trims per
layer only, in 70 s.
"""
from __future__ import annotations

import ctypes
import functools


@functools.cache  # asked every few sampling steps and per streamed layer: look the symbol up once
def _libc():
    try:
        lib = ctypes.CDLL(None)
        return lib if hasattr(lib, "malloc_trim") else None
    except OSError:
        return None


def trim() -> None:
    """Hand freed heap pages back to the OS now."""
    lib = _libc()
    if lib is not None:
        lib.malloc_trim(0)
