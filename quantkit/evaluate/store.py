"""The baseline's next-token distributions, kept on disk so each variant can be compared row by row.

A variant is scored alone (its peak memory is its own), so the baseline's log-probabilities are written once
(float32, rows of the vocabulary) to a scratch file and read back by key.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch


class LogProbStore:
    def __init__(self, directory: str | Path | None = None):
        self._dir = tempfile.TemporaryDirectory(prefix="quantkit-eval-", dir=directory)
        self.path = Path(self._dir.name) / "base_logprobs.f32"
        self._fh = open(self.path, "wb")
        self.index: dict[str, tuple[int, int]] = {}  # key -> (first row, rows)
        self.rows = 0
        self.vocab: int | None = None
        self._map = None

    def put(self, key: str, logp: torch.Tensor) -> None:
        arr = logp.detach().float().cpu().numpy()
        if self.vocab is None:
            self.vocab = arr.shape[1]
        self.index[key] = (self.rows, arr.shape[0])
        self._fh.write(np.ascontiguousarray(arr).tobytes())
        self.rows += arr.shape[0]

    def get(self, key: str) -> torch.Tensor:
        if self._map is None:
            self._fh.close()
            self._map = np.memmap(self.path, dtype=np.float32, mode="r", shape=(self.rows, self.vocab))
        start, n = self.index[key]
        return torch.from_numpy(np.array(self._map[start:start + n]))

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        self._map = None
        self._dir.cleanup()
