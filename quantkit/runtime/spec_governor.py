"""When to draft: speculation pays only while drafts are accepted, so back off while they are not.

A verify forward over k+1 tokens costs more than a one-token step (a little on a GPU, nearly k+1 times on a
small CPU model), so a drafter whose proposals keep being rejected makes decoding slower, as prompt lookup does
on open prose. The governor keeps a moving average of the accepted fraction of drafted tokens; when it falls
below `min_rate` it pauses drafting for a number of steps that doubles on every relapse (up to `max_pause`)
and resets once drafts are accepted again. Skipping a draft never changes what is sampled, only its cost.
"""
from __future__ import annotations


class SpeculationGovernor:
    def __init__(self, min_rate: float = 0.25, smoothing: float = 0.3, first_pause: int = 2, max_pause: int = 32):
        self.min_rate, self.smoothing = min_rate, smoothing
        self.first_pause, self.max_pause = first_pause, max_pause
        self.rate = 1.0  # optimistic start: every request gets to try drafting
        self.pause = first_pause
        self.skip = 0

    def allow(self) -> bool:
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def update(self, accepted: int, drafted: int) -> None:
        if drafted <= 0:
            return
        self.rate += self.smoothing * (accepted / drafted - self.rate)
        if self.rate < self.min_rate:
            self.skip = self.pause
            self.pause = min(self.pause * 2, self.max_pause)
            self.rate = self.min_rate  # after the pause, one good step is enough to keep drafting
        elif accepted == drafted:
            self.pause = self.first_pause
