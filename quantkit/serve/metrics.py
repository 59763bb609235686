"""HTTP-level metrics: responses by status code, counted where every response passes (refusals by the guards
included), rendered after the engine's own totals (runtime/metrics.py) at /metrics."""
from __future__ import annotations

import collections
import threading


class StatusCounter:
    """Pure ASGI middleware counting responses by status."""

    def __init__(self, app, counts: "ResponseCounts"):
        self.app, self.counts = app, counts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start":
                self.counts.add(message["status"])
            await send(message)

        await self.app(scope, receive, counted)


class ResponseCounts:
    def __init__(self):
        self._lock = threading.Lock()
        self._by_status: collections.Counter[int] = collections.Counter()

    def add(self, status: int) -> None:
        with self._lock:
            self._by_status[status] += 1

    def get(self, status: int) -> int:
        with self._lock:
            return self._by_status[status]

    def render(self) -> str:
        name = "quantkit_http_responses_total"
        out = [f"# HELP {name} HTTP responses by status code (499: the client went away first)",
               f"# TYPE {name} counter"]
        with self._lock:
            out += [f'{name}{{code="{code}"}} {n}' for code, n in sorted(self._by_status.items())]
        return "\n".join(out) + "\n"
