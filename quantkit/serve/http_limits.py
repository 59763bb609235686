"""Connection-level limits uvicorn lacks: a deadline for a request's headers.

uvicorn's keep-alive timer runs only between requests and stops at the first byte, so a client that sends
half a request header holds its connection (and a file descriptor) for as long as it likes, and enough such
clients exhaust the server. Here each connection must finish a request's headers within `header_timeout`
seconds of opening, or of the previous response ending; otherwise it is closed. The body is not timed: its
size is bounded (--max-body-bytes) and a slow upload is a client's right.
"""
from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

class HeaderDeadlineProtocol(H11Protocol):
    header_timeout = 10.0  # ServeConfig.header_timeout sets it (header_deadline_protocol)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._deadline = None
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout, self._too_slow)

    def _disarm(self) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a request's headers have arrived whole
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm()  # the next request's headers are due


def header_deadline_protocol(seconds: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class uvicorn builds per connection, with SECONDS as its header deadline."""
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout": seconds})
