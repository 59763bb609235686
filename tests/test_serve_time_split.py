"""Issue 41, requirement 3: each request's time in the server is split into tokenise, queue, prefill and
decode (GET /v1/details/{id}, metrics.split_s), so bench/serve_split.py can say where serving overhead goes.
The parts must be measured at the right moments: they add up to the request's time in the server, that time
fits inside what the client measured, and a request that waited for a decode slot shows the wait as queue."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from quantkit.testing.models import single_thread
from serve_fixtures import model, tok  # noqa: F401
from serve_helpers import NAME, Served

PARTS = ("tokenise", "queue", "prefill", "decode")


def _complete(server, max_tokens: int) -> tuple[dict, float]:
    body = {"model": NAME, "prompt": "a b c " * 20, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    r = server.post("/v1/completions", body)
    elapsed = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    details = httpx.get(f"{server.url}/v1/details/{r.headers['x-request-id']}").json()
    return details["metrics"], elapsed


@pytest.fixture(scope="module")
def one_slot_server(model, tok):  # noqa: F811
    with single_thread():
        s = Served(model, tok, engine_kw={"max_active": 1})
        yield s
        s.stop()


def test_the_parts_add_up_inside_what_the_client_measured(one_slot_server):
    m, elapsed = _complete(one_slot_server, 24)
    split = m["split_s"]
    assert set(split) == set(PARTS) and all(split[p] is not None and split[p] >= 0 for p in PARTS), split
    assert 0 < sum(split.values()) <= elapsed
    # decode covers the 23 tokens after the first, at the per-token time the metrics report
    assert split["decode"] == pytest.approx(m["tpot_s"] * 23, rel=1e-6)


def test_a_request_waiting_for_the_only_slot_shows_the_wait_as_queue(one_slot_server, monkeypatch):
    # The engine's own clock decides: the server-side moments of both requests are kept as they finish, so
    # no client-side guess of the HTTP hop enters the check.
    engine, seen = one_slot_server.engine, {}
    finish = engine._finish
    monkeypatch.setattr(engine, "_finish", lambda req: (seen.__setitem__(req.id, req.seq.metrics), finish(req)))
    body = {"model": NAME, "prompt": "a b c " * 20, "max_tokens": 180, "temperature": 0, "ignore_eos": True,
            "stream": True}
    first: dict = {}
    with httpx.stream("POST", one_slot_server.url + "/v1/completions", json=body, timeout=60) as r:
        first["id"] = r.headers["x-request-id"]
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # the first holds the one decode slot now
        t = threading.Thread(target=lambda: first.update(second=_complete(one_slot_server, 4)[0]))
        t.start()
        for _ in lines:
            pass
    t.join()
    a, b = seen[first["id"]], first["second"]
    b_seen = next(m for rid, m in seen.items() if rid != first["id"])
    assert b_seen.t_received < a.t_last, "the second request must arrive while the first decodes"
    # it could start only once the first finished, so its queue spans at least the first's work left after it
    # was tokenised; that wait is queue, not prefill
    assert b["split_s"]["queue"] >= a.t_last - b_seen.t_start, (b["split_s"], a.t_last - b_seen.t_start)
    assert b["split_s"]["prefill"] < b["split_s"]["queue"]
