"""Inputs that used to end in a 500 (issue 20): each is now a 400 with an OpenAI-style error body, nothing is
logged at error level, and the server keeps serving with every decode slot free."""
import copy
import json
import logging

import pytest

from quantkit.testing.models import single_thread

from serve_helpers import NAME, Served, assert_error, wait_idle
from serve_fixtures import model, server, tok  # noqa: F401  (fixtures)


@pytest.fixture
def error_log():
    """Records uvicorn logs at error level (an exception in the app is logged there with its traceback)."""
    records = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _completion(**kw) -> bytes:
    return json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 2, **kw}).encode()


def _chat(content) -> bytes:
    return json.dumps({"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 2}).encode()


# Raw bodies: json.dumps writes a lone surrogate as the escape \ud800, which Python's JSON parser accepts.
CASES = [
    ("/v1/completions", _completion(seed=2 ** 64), "seed"),
    ("/v1/completions", _completion(seed=-2 ** 63 - 1), "seed"),
    ("/v1/completions", _completion(prompt="abc \ud800 def"), "prompt"),
    ("/v1/completions", _completion(prompt=["\udfff"]), "prompt"),
    ("/v1/completions", _completion(stop=["\ud800"]), "stop"),
    ("/v1/completions", json.dumps({"model": "\ud800", "prompt": "hi"}).encode(), "model"),
    ("/v1/chat/completions", _chat("hello \ud800"), "messages"),
    ("/v1/chat/completions", _chat([{"type": "text", "text": "\ud800"}]), "messages"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "temperature": Infinity}', None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "top_p": -Infinity}', None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "temperature": 1e999}', None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", None),
    ("/v1/completions", _completion(prompt=[1, 2, 10 ** 6]), "prompt"),
    ("/v1/completions", _completion(prompt=[1, -2]), "prompt"),
    ("/v1/completions", _completion(stop=["x"] * 17), "stop"),
    ("/v1/completions", _completion(stop="x" * 1001), "stop"),
    ("/v1/chat/completions", _chat([{"type": "text", "text": 5}]), "messages"),
    ("/v1/chat/completions", _chat([{"type": "image_url", "image_url": {"url": "x"}}]), "messages"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi"}\xff', None),
]


@pytest.mark.parametrize("path,raw,param", CASES, ids=range(len(CASES)))
def test_former_500s_are_400s(server, error_log, path, raw, param):
    r = server.post(path, content=raw)
    assert_error(r, 400, param)
    assert not error_log, error_log[0].getMessage()
    ok = server.post("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200
    wait_idle(server.engine)


def test_a_tiny_temperature_is_greedy_not_nan(server, error_log):
    # 1e-300 made float32 logits / temperature infinite and the probabilities NaN: the engine's step failed
    greedy = server.post("/v1/completions", {"model": NAME, "prompt": "Once upon", "max_tokens": 6,
                                             "temperature": 0})
    tiny = server.post("/v1/completions", {"model": NAME, "prompt": "Once upon", "max_tokens": 6,
                                           "temperature": 1e-300, "seed": 1})
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    assert not error_log


def test_a_chat_template_that_refuses_is_a_400(model, tok, error_log):
    strict = copy.deepcopy(tok)
    strict.chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    with single_thread():
        s = Served(model, strict)
    try:
        r = s.post("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}]})
        err = assert_error(r, 400, "messages")
        assert "roles must alternate" in err["message"]
        assert not error_log
    finally:
        s.stop()


def test_surrogate_in_an_unknown_key_is_named_safely(server):
    r = server.post("/v1/completions", content=b'{"model": "tiny", "prompt": "hi", "\\ud800": 1}')
    err = assert_error(r, 400)
    assert "ud800" in err["message"]
