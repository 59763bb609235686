"""Calibration activations kept on disk when they would not fit beside the rest of the run.

Layer by layer, the run holds each sample's hidden state twice: a layer's inputs, and its outputs as they are made
(the next layer's inputs). That is 2 x tokens x hidden numbers, and it grows with the calibration while everything
else a streamed run holds is bounded by one layer: the default's 128 x 512 tokens are 302 MB for SmolLM2-135M in
float32 (more than half of a cap below its 538 MB float model), 2.1 GB for a 70B in bfloat16. So when both sets
would take more than SHARE of the memory quantkit is given (--max-memory, else what the device has free), each set
is written to one file as it is made and every sample read back when a pass reaches it: the run then holds one
sample's state at a time, and the page cache, which the kernel drops under pressure, holds the rest.

SHARE leaves the other three quarters to what a layer's solve holds beside its activations: the float layer, the
solvers' statistics (a float64 Hessian per input group), AWQ's recorded block calls, the allocator's slack.
Reading is exact (the bytes written), so a run that spills writes the same checkpoint as one that does not.
"""
from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from ..errors import UserError

SHARE = 0.25


class DiskStates(Sequence):
    """Hidden states appended to one file and read back one at a time, on DEVICE."""

    def __init__(self, path: Path, device):
        self.path, self.device = path, device
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._entries: list[tuple[int, torch.Size, torch.dtype]] = []  # (offset, shape, dtype)
        self._end = 0

    def append(self, t: torch.Tensor) -> None:
        data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        try:
            written = os.pwrite(self._fd, data, self._end)
            while written < data.nbytes:  # a short write on a nearly full disk
                written += os.pwrite(self._fd, data[written:], self._end + written)
        except OSError as e:
            self.close()
            hint = ("free some space there, or lower --num-samples / --seq-len" if e.errno == errno.ENOSPC
                    else "check that disk, or raise --max-memory so they stay in memory")
            raise UserError(f"keeping calibration activations in '{self.path.parent}' failed: "
                            f"{os.strerror(e.errno or 0)}; {hint}") from None
        self._entries.append((self._end, t.shape, t.dtype))
        self._end += data.nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, j):
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        offset, shape, dtype = self._entries[j]
        out = torch.empty(shape, dtype=dtype)
        buf = out.reshape(-1).view(torch.uint8).numpy()
        got = os.preadv(self._fd, [buf], offset)
        if got != buf.nbytes:
            raise RuntimeError(f"{self.path}: read {got} of {buf.nbytes} bytes of a calibration activation")
        return out.to(self.device)

    def nbytes(self) -> int:
        return self._end

    def shapes(self) -> list[torch.Size]:
        """Every entry's shape, without reading one back."""
        return [shape for _o, shape, _d in self._entries]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self.path.unlink(missing_ok=True)


class _Subset(Sequence):
    """Some of a DiskStates' entries, in the order given, still read one at a time."""

    def __init__(self, states: DiskStates, idx: list[int]):
        self.states, self.idx = states, list(idx)

    def __len__(self) -> int:
        return len(self.idx)

    def __getitem__(self, j):
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        return self.states[self.idx[j]]


def subset(states, idx: list[int]):
    """STATES[j] for j in IDX: a list for states in memory, a view that reads on access for states on disk."""
    if isinstance(states, DiskStates):
        return _Subset(states, idx)
    if isinstance(states, _Subset):
        return _Subset(states.states, [states.idx[j] for j in idx])
    return [states[j] for j in idx]


class _Mapped(Sequence):
    """FN of each of a set's entries, computed as it is read."""

    def __init__(self, states, fn):
        self.states, self.fn = states, fn

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, j):
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        return self.fn(self.states[j])


def _file_of(states) -> DiskStates | None:
    while isinstance(states, (_Subset, _Mapped)):
        states = states.states
    return states if isinstance(states, DiskStates) else None


def shapes(states) -> list[torch.Size]:
    """Every entry's shape, without reading a spilled one back."""
    if isinstance(states, DiskStates):
        return states.shapes()
    if isinstance(states, _Subset):
        every = shapes(states.states)
        return [every[j] for j in states.idx]
    if isinstance(states, _Mapped):
        return shapes(states.states)
    return [t.shape for t in states]


def mapped(states, fn):
    """FN of every entry of STATES: computed now for states in memory, on each read for states on disk (a copy of
    every sample, e.g. in float32 for learned rounding, must not bring them all back into memory)."""
    return [fn(t) for t in states] if _file_of(states) is None else _Mapped(states, fn)


def beside(states, name: str):
    """An empty set kept the way STATES is: a list when it is in memory, a file NAME next to its file on disk."""
    f = _file_of(states)
    return [] if f is None else DiskStates(f.path.parent / name, f.device)


class Spill:
    """Where each set of a run's hidden states goes: a list in memory, or a DiskStates file in FOLDER once
    decide() found both sets larger than SHARE of CAP bytes."""

    def __init__(self, folder: Path | None, cap: int | None):
        self.folder, self.cap = folder, cap
        self.on_disk = False
        self._count = 0

    def decide(self, set_bytes: int) -> bool:
        """Whether sets of SET_BYTES each go to disk (two are held at once); None folder or cap: never."""
        self.on_disk = self.folder is not None and self.cap is not None and 2 * set_bytes > SHARE * self.cap
        return self.on_disk

    def new(self, device) -> list | DiskStates:
        if not self.on_disk:
            return []
        self.folder.mkdir(parents=True, exist_ok=True)
        self._count += 1
        return DiskStates(self.folder / f"states-{self._count}.bin", device)


def release(states) -> None:
    """Let go of a set of states that is no longer read (its file, when it has one)."""
    if isinstance(states, DiskStates):
        states.close()
