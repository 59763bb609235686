"""When to draft: speculation pays only while it yields tokens faster than plain steps do, so back off when not.

A verify forward over k+1 tokens costs more than a one-token step (a little on a GPU, nearly k+1 times on a
small CPU model), and a draft model costs its own forwards, so speculation can make decoding slower two ways:
drafts that keep being rejected (prompt lookup on open prose), and drafts that are accepted but cost more than
they save (a W4 draft of a float16 target whose plain step is not much slower than the draft's). The governor
watches both. It keeps a moving average of the accepted fraction of drafted tokens, and, when the caller passes
each step's wall time, moving averages of the seconds per emitted token of drafting steps and of plain ones.
When the accepted fraction falls below `min_rate`, it pauses drafting for a number of steps that doubles on
every relapse (up to `max_pause`) and resets once a draft is fully accepted. When drafting steps take `slack`
times longer per token than plain ones (near break-even either choice costs the same, and one step slowed by
the machine should not count), it pauses for at least as long, and long enough that trying again costs at most
`overhead` of the decoding time in between (up to `max_timed_pause`): a W4 draft that costs ten plain steps
more than it saves is tried again after ~200 steps, not 32. Plain steps are timed when they happen anyway (a
pause; prompt lookup finding no match); a drafter that spends more than `probe_share` of a step drafting (a
draft model) also gets a plain step forced after `probe_after` drafting steps while there is no plain time to
compare with, and every `refresh` drafting steps after (a step's cost grows with the context). A nearly free
drafter (prompt lookup) is not probed: a forced plain step would throw away a likely-accepted draft, and the
accepted fraction already stops it where its verify rows are wasted. Skipping a draft never changes what is
sampled, only its cost.
"""
from __future__ import annotations

import math


class SpeculationGovernor:
    def __init__(self, min_rate: float = 0.25, smoothing: float = 0.3, first_pause: int = 2, max_pause: int = 32,
                 probe_after: int = 3, refresh: int = 32, slack: float = 1.1, overhead: float = 0.05,
                 max_timed_pause: int = 512, probe_share: float = 0.2):
        self.min_rate, self.smoothing = min_rate, smoothing
        self.first_pause, self.max_pause = first_pause, max_pause
        self.probe_after, self.refresh, self.slack = probe_after, refresh, slack
        self.overhead, self.max_timed_pause, self.probe_share = overhead, max_timed_pause, probe_share
        self.draft_share: float | None = None  # moving average of the drafting part of a drafting step's time
        self.rate = 1.0  # optimistic start: every request gets to try drafting
        self.pause = first_pause
        self.skip = 0
        # moving averages of (seconds, tokens) per step, drafting and plain: their ratio is the cost of a token
        # (an average of per-step ratios would let one refused draft outweigh several accepted ones)
        self._spec: tuple[float, float] | None = None
        self._plain: tuple[float, float] | None = None
        self._since_plain = 0  # drafting steps since the last timed plain step

    def allow(self) -> bool:
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def _back_off(self) -> None:
        self.skip = max(self.skip, self.pause)
        self.pause = min(self.pause * 2, self.max_pause)

    def update(self, accepted: int, drafted: int, seconds: float | None = None, draft_seconds: float = 0.0) -> None:
        """A drafting step: `accepted` of `drafted` tokens kept (plus the one the target adds), in `seconds`, of
        which `draft_seconds` went to proposing the draft."""
        if drafted <= 0:
            return
        self.rate += self.smoothing * (accepted / drafted - self.rate)
        slower = False
        if seconds is not None and seconds > 0:
            self._spec = self._average(self._spec, seconds, accepted + 1)
            self._since_plain += 1
            share = draft_seconds / seconds
            self.draft_share = share if self.draft_share is None else \
                self.draft_share + self.smoothing * (share - self.draft_share)
            slower = self.plain_spt is not None and self.spec_spt > self.plain_spt * self.slack
            wanted = self.probe_after if self.plain_spt is None else self.refresh
            if self._since_plain >= wanted and self.draft_share > self.probe_share:
                self.skip = max(self.skip, 1)  # time one plain step
        if self.rate < self.min_rate:
            self._back_off()
            self.rate = self.min_rate  # after the pause, one good step is enough to keep drafting
        elif slower:
            # an average drafting step costs `excess` seconds more than plain steps would for its tokens
            excess = (self.spec_spt - self.plain_spt) * self._spec[1]
            self._back_off()
            self.skip = max(self.skip, min(math.ceil(excess / (self.overhead * self.plain_spt)), self.max_timed_pause))
        elif accepted == drafted:
            self.pause = self.first_pause

    def plain_step(self, seconds: float) -> None:
        """A step that drafted nothing (paused, or the drafter had nothing to propose) took `seconds`."""
        if seconds <= 0:  # a clock that did not move says nothing (and would divide by zero below)
            return
        self._plain = self._average(self._plain, seconds, 1)
        self._since_plain = 0

    def _average(self, old: tuple[float, float] | None, seconds: float, tokens: int) -> tuple[float, float]:
        if old is None:
            return seconds, float(tokens)
        return old[0] + self.smoothing * (seconds - old[0]), old[1] + self.smoothing * (tokens - old[1])

    @property
    def spec_spt(self) -> float | None:
        """Seconds per emitted token of drafting steps (moving average), None before the first."""
        return None if self._spec is None else self._spec[0] / self._spec[1]

    @property
    def plain_spt(self) -> float | None:
        return None if self._plain is None else self._plain[0] / self._plain[1]
