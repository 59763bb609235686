"""Logits that are computed only when asked for: the rows of one sequence in a forward."""
from __future__ import annotations

import torch


class Rows:
    """The logits of one sequence's rows in a forward, computed from the final hidden states when first asked
    for. A verify forward's draft is checked row by row and a rejection ends it, and the output head is most
    of what a k+1-row verify costs on a CPU (13 rows of SmolLM2's head: 24 ms, one: 5 ms), so row 0 is computed
    alone and the rest only once row 0's token is accepted."""

    def __init__(self, logits: torch.Tensor | None = None, hidden: torch.Tensor | None = None, head=None):
        self.n = logits.shape[0] if logits is not None else hidden.shape[0]
        self._logits = logits  # every row, once computed
        self._first = None  # row 0 alone, while the rest is not needed yet
        self._hidden, self._head = hidden, head

    def __len__(self) -> int:
        return self.n

    def upto(self, stop: int) -> torch.Tensor:
        """Logits of rows [0, stop)."""
        if self._logits is None:
            with torch.inference_mode():  # the hidden states were made under it, and nothing here needs grad
                if stop <= 1 and self.n > 1:
                    if self._first is None:
                        self._first = self._head(self._hidden[:1])
                    return self._first[:stop]
                if self._first is None:
                    self._logits = self._head(self._hidden)
                else:
                    self._logits = torch.cat([self._first, self._head(self._hidden[1:])])
        return self._logits[:stop]

    def all(self) -> torch.Tensor:
        return self.upto(self.n)
