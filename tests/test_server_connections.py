"""Issue 37.5: a connection that sends half a request header is closed after --header-timeout (it stayed open
indefinitely), between requests on a kept-alive connection too; beyond --max-connections requests get 503."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn

from quantkit.serve.config import ServeConfig
from quantkit.serve.http_limits import header_deadline_protocol

from helpers import free_port

REQUEST = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


async def hello(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def served():
    """hello served with a 0.5 s header deadline and at most 3 connections."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(hello, host="127.0.0.1", port=port, log_level="error",
                                           http=header_deadline_protocol(0.5), limit_concurrency=3))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(timeout=10)


def _connect(port) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _response(s: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\r\n\r\nok") and b" 503 " not in data:
        data += s.recv(4096)
    return data


def _closed_within(s: socket.socket, seconds: float) -> bool:
    s.settimeout(seconds)
    try:
        while s.recv(4096):
            pass
        return True
    except TimeoutError:
        return False


def test_half_a_header_is_closed_after_the_deadline(served):
    s = _connect(served)
    s.sendall(b"GET / HTTP/1.1\r\nHost: 127.")
    t = time.monotonic()
    assert _closed_within(s, 5) and time.monotonic() - t < 3


def test_a_kept_alive_connection_gets_a_new_deadline_per_request(served):
    s = _connect(served)
    for _ in range(3):  # each request well within the deadline: served, and the connection stays
        s.sendall(REQUEST)
        assert _response(s).startswith(b"HTTP/1.1 200")
        time.sleep(0.2)
    s.sendall(b"GET / HTTP/1.1\r\n")  # then half a header
    assert _closed_within(s, 5)


def test_an_idle_new_connection_is_closed(served):
    assert _closed_within(_connect(served), 5)


def test_connections_beyond_the_limit_get_503(served):
    idle = [_connect(served) for _ in range(3)]
    time.sleep(0.1)
    s = _connect(served)
    s.sendall(REQUEST)
    assert s.recv(4096).startswith(b"HTTP/1.1 503")
    for c in idle:
        c.close()


def test_serve_passes_the_limits_to_uvicorn(monkeypatch):
    import quantkit.cli.serve_cmd as serve_cmd

    seen = {}

    class FakeServer:
        def __init__(self, config):
            seen["config"] = config

        def run(self, sockets):
            pass

    class FakeEngine:
        """Its loop waits for close(), which the server's end calls: run() returns only if it does."""
        def __init__(self):
            self.closed = threading.Event()

        def run(self):
            seen["loop on main thread"] = threading.current_thread() is threading.main_thread()
            assert self.closed.wait(timeout=30)

        def close(self):
            self.closed.set()

    monkeypatch.setattr(uvicorn, "Server", FakeServer)
    monkeypatch.setattr("quantkit.serve.app.create_app", lambda *a, **k: hello)
    monkeypatch.setattr("quantkit.serve.playground.mount", lambda app, compare: app)
    config = ServeConfig(header_timeout=2.5, max_connections=7)
    serve_cmd.run(FakeEngine(), None, "m", config, socket.socket())
    config = seen["config"]
    assert config.http.header_timeout == 2.5 and config.limit_concurrency == 7
    # decode on a worker thread ran 1.8x slower on a CPU (runtime/engine.py)
    assert seen["loop on main thread"]


@pytest.mark.parametrize("flag, value, words", [("--header-timeout", "0", "--header-timeout must be between"),
                                                ("--max-connections", "0", "--max-connections must be at least 1")])
def test_bad_limits_are_one_line(cli, flag, value, words):
    code, _, err = cli("serve", "embedded", flag, value)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1
