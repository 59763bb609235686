"""Request latency and throughput from timed greedy generations."""
from __future__ import annotations

from .agreement import percentile


def latency_stats(seconds: list[float], tokens: list[int], ttft: list[float]) -> dict:
    total_s = sum(seconds)
    return {"requests": len(seconds), "p50_s": percentile(seconds, 50), "p99_s": percentile(seconds, 99),
            "ttft_p50_s": percentile([t for t in ttft if t is not None], 50),
            "tokens": sum(tokens), "tokens_per_s": sum(tokens) / total_s if total_s > 0 else None}
