"""When to draft: speculation pays only while it yields tokens faster than plain steps do, so back off when not.

A verify forward over k+1 tokens costs more than a one-token step (a little on a GPU, nearly k+1 times on a
small CPU model), and a draft model costs its own forwards, so speculation can make decoding slower two ways:
drafts that keep being rejected (prompt lookup on open prose), and drafts that are accepted but cost more than
they save (a W4 draft of a float16 target whose plain step is not much slower than the draft's). The governor
watches both. It keeps a moving average of the accepted fraction of drafted tokens, and, when the caller passes
each step's wall time, moving averages of the seconds per emitted token of drafting steps and of plain ones.
When the accepted fraction falls below `min_rate`, or drafting steps take `slack` times longer per token than
plain ones (near break-even either choice costs the same, and one step slowed by the machine should not count), it
pauses drafting for a number of steps that doubles on every relapse (up to `max_pause`) and resets once a draft
is fully accepted and drafting is the faster. While it has no plain-step time to compare with, it takes one
plain step after `probe_after` drafting steps, and it refreshes that figure every `refresh` drafting steps
(a step's cost grows with the context). Skipping a draft never changes what is sampled, only its cost.
"""
from __future__ import annotations


def _ema(old: float | None, new: float, smoothing: float) -> float:
    return new if old is None else old + smoothing * (new - old)


class SpeculationGovernor:
    def __init__(self, min_rate: float = 0.25, smoothing: float = 0.3, first_pause: int = 2, max_pause: int = 32,
                 probe_after: int = 2, refresh: int = 32, slack: float = 1.1):
        self.min_rate, self.smoothing = min_rate, smoothing
        self.first_pause, self.max_pause = first_pause, max_pause
        self.probe_after, self.refresh, self.slack = probe_after, refresh, slack
        self.rate = 1.0  # optimistic start: every request gets to try drafting
        self.pause = first_pause
        self.skip = 0
        self.spec_spt: float | None = None  # seconds per emitted token, drafting steps
        self.plain_spt: float | None = None  # seconds per token, plain steps
        self._since_plain = 0  # drafting steps since the last timed plain step

    def allow(self) -> bool:
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def _back_off(self) -> None:
        self.skip = max(self.skip, self.pause)
        self.pause = min(self.pause * 2, self.max_pause)

    def update(self, accepted: int, drafted: int, seconds: float | None = None) -> None:
        """A drafting step: `accepted` of `drafted` tokens kept (plus the one the target adds), in `seconds`."""
        if drafted <= 0:
            return
        self.rate += self.smoothing * (accepted / drafted - self.rate)
        slower = False
        if seconds is not None:
            self.spec_spt = _ema(self.spec_spt, seconds / (accepted + 1), self.smoothing)
            self._since_plain += 1
            slower = self.plain_spt is not None and self.spec_spt > self.plain_spt * self.slack
            wanted = self.probe_after if self.plain_spt is None else self.refresh
            if self._since_plain >= wanted:
                self.skip = max(self.skip, 1)  # time one plain step
        if self.rate < self.min_rate:
            self._back_off()
            self.rate = self.min_rate  # after the pause, one good step is enough to keep drafting
        elif slower:
            self._back_off()
        elif accepted == drafted:
            self.pause = self.first_pause

    def plain_step(self, seconds: float) -> None:
        """A step that drafted nothing (paused, or the drafter had nothing to propose) took `seconds`."""
        self.plain_spt = _ema(self.plain_spt, seconds, self.smoothing)
        self._since_plain = 0
