"""Solved codes kept on disk until the checkpoint is written.

While a model streams from disk one decoder layer at a time (models/lazy.py), everything the run holds is bounded
by one layer except the solved codes: they accumulate until the writer packs them (a 70B's int8 codes are 70 GB,
SmolLM2's 106 MB, a quarter of what its capped default may hold). So each Linear's QWeight is saved here as it is
solved and mapped back read-only (torch.load with mmap): its pages are file-backed, so the kernel drops them under
memory pressure and reads them again when the writer packs that Linear.

The folder is one the caller made for the run (the output claim's temporary folder, which a killed run's
successor clears) and is removed on leaving the with block.
"""
from __future__ import annotations

import io
import shutil
from dataclasses import fields, replace
from pathlib import Path

import torch

from ..qweight import QWeight
from .write_failure import write_failure


class CodeSpool:
    def __init__(self, folder: Path, out: Path):
        """folder: an empty folder this run created; out: the checkpoint folder, named in a failed write's line."""
        self.folder, self.out = folder, out
        self._count = 0

    def keep(self, qw: QWeight) -> QWeight:
        """QW with its tensors saved to the spool and mapped back from the file."""
        tensors = {f.name: getattr(qw, f.name) for f in fields(qw) if isinstance(getattr(qw, f.name), torch.Tensor)}
        path = self.folder / f"{self._count}.pt"
        self._count += 1
        # serialised in memory (one Linear's codes) and written by Python: torch.save straight to a path reports a
        # full disk as an iostream error without its errno
        buf = io.BytesIO()
        torch.save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, buf)
        try:
            path.write_bytes(buf.getbuffer())
        except BaseException as e:
            failure = write_failure(e, self.out.parent, self.out)
            if failure is not None:
                raise failure from None
            raise
        return replace(qw, **torch.load(path, mmap=True, weights_only=True))

    def __enter__(self) -> "CodeSpool":
        return self

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
