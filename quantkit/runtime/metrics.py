"""Decode metrics: per request (returned by `quantkit generate --json`) and server-wide (Prometheus text)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    prompt_tokens: int = 0
    output_tokens: int = 0
    target_forwards: int = 0  # prefill included: it produces the first token
    spec_steps: int = 0  # verify forwards that checked at least one drafted token
    drafted: int = 0
    accepted: int = 0
    t_start: float = field(default_factory=time.perf_counter)  # the prompt's ids are ready (tokenised)
    t_received: float | None = None  # the server's handler began (no server: None)
    t_admitted: float | None = None  # the engine gave it a decode slot (no engine: None)
    t_first: float | None = None
    t_last: float | None = None

    def on_tokens(self, n: int) -> None:
        now = time.perf_counter()
        if self.t_first is None and n:
            self.t_first = now
        self.t_last = now
        self.output_tokens += n

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_length(self) -> float | None:
        # Tokens a verify forward yields: the accepted drafts plus the one the target adds itself.
        return (self.accepted + self.spec_steps) / self.spec_steps if self.spec_steps else None

    @property
    def tokens_per_target_forward(self) -> float | None:
        return self.output_tokens / self.target_forwards if self.target_forwards else None

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_start

    @property
    def tpot_s(self) -> float | None:
        if self.t_first is None or self.output_tokens < 2:
            return None
        return (self.t_last - self.t_first) / (self.output_tokens - 1)

    def split_s(self) -> dict[str, float | None]:
        """Where a request's time went, in order: reading and tokenising it (HTTP body, validation, template),
        waiting for a decode slot, the prefill up to the first token, the decode of the rest. They add up to
        its time in the server; what a client measures beyond that is HTTP."""
        admitted = self.t_admitted if self.t_admitted is not None else self.t_start
        return {"tokenise": None if self.t_received is None else self.t_start - self.t_received,
                "queue": None if self.t_admitted is None else self.t_admitted - self.t_start,
                "prefill": None if self.t_first is None else self.t_first - admitted,
                "decode": None if self.t_first is None else self.t_last - self.t_first}

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("prompt_tokens", "output_tokens", "target_forwards", "spec_steps",
                                           "drafted", "accepted", "acceptance_rate", "mean_accepted_length",
                                           "tokens_per_target_forward", "ttft_s", "tpot_s")}
        d["split_s"] = self.split_s()
        if self.t_last is not None and self.t_first is not None and self.output_tokens > 1:
            d["decode_tokens_per_s"] = (self.output_tokens - 1) / max(self.t_last - self.t_first, 1e-9)
        return d


class ServerMetrics:
    """Totals over finished requests, plus live gauges, rendered in the Prometheus text format."""

    def __init__(self):
        self._lock = threading.Lock()
        self.t0 = time.perf_counter()
        self.requests = 0
        self.rejected = 0
        self.cancelled = 0
        self.failed = 0
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.target_forwards = 0
        self.drafted = 0
        self.accepted = 0
        self.spec_steps = 0
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.tpot_sum = 0.0
        self.tpot_count = 0
        self.active = 0
        self.queued = 0

    def count(self, name: str) -> None:
        """One more request that ended without finishing: "cancelled" (its client went away) or "failed"."""
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)

    def finish(self, m: RequestMetrics) -> None:
        with self._lock:
            self.requests += 1
            self.prompt_tokens += m.prompt_tokens
            self.output_tokens += m.output_tokens
            self.target_forwards += m.target_forwards
            self.drafted += m.drafted
            self.accepted += m.accepted
            self.spec_steps += m.spec_steps
            if m.ttft_s is not None:
                self.ttft_sum += m.ttft_s
                self.ttft_count += 1
            if m.tpot_s is not None:
                self.tpot_sum += m.tpot_s
                self.tpot_count += 1

    def render(self) -> str:
        with self._lock:
            up = time.perf_counter() - self.t0
            rows = [
                ("quantkit_requests_total", "counter", "finished requests", self.requests),
                ("quantkit_requests_rejected_total", "counter", "requests refused with 429 (queue full)",
                 self.rejected),
                ("quantkit_requests_cancelled_total", "counter", "requests dropped because the client went away",
                 self.cancelled),
                ("quantkit_requests_failed_total", "counter", "requests that ended in a server error",
                 self.failed),
                ("quantkit_prompt_tokens_total", "counter", "prompt tokens of finished requests", self.prompt_tokens),
                ("quantkit_output_tokens_total", "counter", "generated tokens of finished requests",
                 self.output_tokens),
                ("quantkit_target_forwards_total", "counter", "target model forwards", self.target_forwards),
                ("quantkit_drafted_tokens_total", "counter", "speculative tokens proposed", self.drafted),
                ("quantkit_accepted_tokens_total", "counter", "speculative tokens accepted", self.accepted),
                ("quantkit_tokens_per_second", "gauge", "output tokens per second since start",
                 self.output_tokens / up if up > 0 else 0.0),
                ("quantkit_acceptance_rate", "gauge", "accepted / drafted speculative tokens",
                 self.accepted / self.drafted if self.drafted else 0.0),
                ("quantkit_mean_accepted_length", "gauge", "tokens per verify forward",
                 (self.accepted + self.spec_steps) / self.spec_steps if self.spec_steps else 0.0),
                ("quantkit_tokens_per_target_forward", "gauge", "output tokens per target forward",
                 self.output_tokens / self.target_forwards if self.target_forwards else 0.0),
                ("quantkit_time_to_first_token_seconds", "gauge", "mean time to first token",
                 self.ttft_sum / self.ttft_count if self.ttft_count else 0.0),
                ("quantkit_time_per_output_token_seconds", "gauge", "mean time per output token after the first",
                 self.tpot_sum / self.tpot_count if self.tpot_count else 0.0),
                ("quantkit_active_requests", "gauge", "requests being decoded", self.active),
                ("quantkit_queued_requests", "gauge", "requests waiting for a decode slot", self.queued),
            ]
        out = []
        for name, kind, help_, value in rows:
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {float(value):.6g}"]
        return "\n".join(out) + "\n"
