"""Requests that cost more than they should: abandoned requests are cancelled, a prompt plus max_tokens beyond
the context is a 400 (or clamped with clamp_max_tokens), bodies are bounded (413), long prompts are tokenised
off the event loop, and /metrics counts cancelled and failed requests."""
import threading
import time

import httpx
import pytest

from quantkit.testing.models import single_thread

from serve_helpers import NAME, Served, assert_error, wait_idle
from serve_fixtures import model, server, tok  # noqa: F401  (fixtures)


def no_eos(tok) -> dict:
    # these tests need requests that run their whole max_tokens unless cancelled: a random model could
    # otherwise reach the end-of-text token after a few steps (and its greedy path depends on float order)
    return {"logit_bias": {str(tok.eos_token_id): -100}}


def _submitted(engine) -> list:
    """Every Request the engine is given from now on."""
    reqs, real = [], engine.submit

    def submit(seq, on_event):
        reqs.append(real(seq, on_event))
        return reqs[-1]

    engine.submit = submit
    return reqs


def _open_and_abandon(url: str, bodies: list[dict], reqs: list, n: int) -> None:
    """Send each body on a socket of its own, wait until the engine holds all N requests, then hang up: a
    client that goes away mid-request, independent of how fast this machine is (a read timeout could fire
    before a loaded server had even taken the request)."""
    import json
    import socket
    from urllib.parse import urlparse

    host, port = urlparse(url).hostname, urlparse(url).port
    socks = []
    for body in bodies:
        data = json.dumps(body).encode()
        sock = socket.create_connection((host, port), timeout=30)
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        socks.append(sock)
    deadline = time.time() + 60
    while len(reqs) < n and time.time() < deadline:
        time.sleep(0.01)
    for sock in socks:
        sock.close()


def test_abandoned_requests_are_cancelled(model, tok):
    with single_thread():
        s = Served(model, tok)
    try:
        reqs = _submitted(s.engine)
        bodies = [{"model": NAME, "prompt": f"story {i}", "max_tokens": 250, "temperature": 1.0, "seed": i,
                   **no_eos(tok)} for i in range(10)]
        _open_and_abandon(s.url, bodies, reqs, 10)
        wait_idle(s.engine, timeout=60)
        assert len(reqs) == 10 and all(r.cancelled for r in reqs)
        # cut short: none decoded its 250 tokens for a client that had gone
        assert max(r.seq.n_generated for r in reqs) < 250, [r.seq.n_generated for r in reqs]
        assert s.metric("quantkit_requests_cancelled_total") == 10
        assert s.metric("quantkit_requests_total") == 0
        assert 'quantkit_http_responses_total{code="499"} 10' in httpx.get(s.url + "/metrics").text
    finally:
        s.stop()


def test_an_abandoned_stream_is_cancelled(model, tok):
    with single_thread():
        s = Served(model, tok)
    try:
        reqs = _submitted(s.engine)
        body = {"model": NAME, "prompt": "story", "max_tokens": 250, "stream": True, **no_eos(tok)}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            next(ln for ln in r.iter_lines() if "quantkit_tokens" in ln)  # the first tokens came; then hang up
        wait_idle(s.engine, timeout=5)
        assert reqs[0].cancelled and reqs[0].seq.n_generated < 250
        assert s.metric("quantkit_requests_cancelled_total") == 1
    finally:
        s.stop()


def test_a_request_abandoned_in_the_queue_never_takes_a_slot(model, tok):
    with single_thread():
        s = Served(model, tok, engine_kw={"max_active": 1})
    # 10 ms per step, so the first request still holds the slot when the second gives up, however fast the CPU
    # (on a 2-core AMD EPYC the tiny model's 200 tokens took less than the client's 0.2 s)
    slow = model.get_input_embeddings().register_forward_hook(lambda *_: time.sleep(0.01))
    try:
        reqs = _submitted(s.engine)
        long = threading.Thread(target=s.post, args=("/v1/completions", {
            "model": NAME, "prompt": "one", "max_tokens": 200, "temperature": 0, **no_eos(tok)}))
        long.start()
        while not reqs:
            time.sleep(0.01)
        with pytest.raises(httpx.ReadTimeout):
            s.post("/v1/completions", {"model": NAME, "prompt": "two", "max_tokens": 200}, timeout=0.2)
        assert not reqs[0].seq.done  # the premise: the only slot was still taken when the client gave up
        long.join()
        wait_idle(s.engine)
        first, second = reqs[0].seq, reqs[1].seq
        assert reqs[1].cancelled and second.n_generated == 0 and not second.prefilled, (
            first.n_generated, first.finish_reason, reqs[0].failed, second.n_generated)
        assert s.metric("quantkit_requests_cancelled_total") == 1
    finally:
        slow.remove()
        s.stop()


def test_prompt_plus_max_tokens_beyond_the_context_is_a_400(server, tok, model):
    ctx = model.config.max_position_embeddings
    prompt = "word " * 100
    n = len(tok(prompt)["input_ids"])
    r = server.post("/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": ctx - n + 1})
    err = assert_error(r, 400, "max_tokens", "context_length_exceeded")
    for figure in (f"{ctx} tokens", f"{n} in the prompt", f"{ctx - n + 1} for the completion"):
        assert figure in err["message"], err["message"]
    ok = server.post("/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": ctx - n, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["total_tokens"] <= ctx
    # not asked for: the default is cut to what the context leaves, as a client cannot know it
    chat = server.post("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": prompt * 2}]})
    assert chat.status_code == 200, chat.text


def test_clamp_max_tokens_cuts_instead(model, tok):
    with single_thread():
        s = Served(model, tok, clamp_max_tokens=True)
    try:
        prompt = "word " * 100
        n = len(tok(prompt)["input_ids"])
        r = s.post("/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": 200, "temperature": 0})
        body = r.json()
        assert r.status_code == 200 and body["usage"]["completion_tokens"] == 256 - n
        assert body["choices"][0]["finish_reason"] == "length"
    finally:
        s.stop()


def test_bodies_are_bounded(server, model, tok):
    r = server.post("/v1/completions", {"model": NAME, "prompt": "hi", "user": "x" * 5_000_000})
    assert_error(r, 413, code="request_too_large")
    with single_thread():
        small = Served(model, tok, max_body_bytes=1000)
    try:
        def body(size):
            head = b'{"model": "tiny", "max_tokens": 1, "prompt": "'
            return head + b"a" * (size - len(head) - 2) + b'"}'

        assert small.post("/v1/completions", content=body(1000)).status_code == 200
        assert_error(small.post("/v1/completions", content=body(1001)), 413, code="request_too_large")
        # no Content-Length to trust: the body is counted as it arrives
        chunks = iter([body(1001)[:600], body(1001)[600:]])
        r = httpx.post(small.url + "/v1/completions", content=chunks, headers={"content-type": "application/json"})
        assert "content-length" not in r.request.headers
        assert_error(r, 413, code="request_too_large")
    finally:
        small.stop()


def test_a_long_prompt_does_not_stall_the_event_loop(server):
    latencies, done = [], threading.Event()

    def poll():
        while not done.is_set():
            t = time.perf_counter()
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
            latencies.append(time.perf_counter() - t)
            time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    t = time.perf_counter()
    r = server.post("/v1/completions", {"model": NAME, "prompt": "word " * 380_000, "max_tokens": 1})
    took = time.perf_counter() - t
    done.set()
    poller.join()
    assert_error(r, 400, "prompt", "context_length_exceeded")
    assert took > 0.4  # long enough to see a stall
    assert max(latencies) < took / 2, (max(latencies), took)


def test_failed_requests_are_counted(model, tok):
    class Broken:
        def propose(self, *a):
            raise RuntimeError("drafter broke")

    with single_thread():
        s = Served(model, tok, engine_kw={"drafter_factory": Broken})
    try:
        r = s.post("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 4})
        assert_error(r, 500)
        assert r.json()["error"]["type"] == "server_error"
        assert s.metric("quantkit_requests_failed_total") == 1
        assert 'quantkit_http_responses_total{code="500"} 1' in httpx.get(s.url + "/metrics").text
        wait_idle(s.engine)
    finally:
        s.stop()
