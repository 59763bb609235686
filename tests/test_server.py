"""The OpenAI-compatible server, driven by the official client and by raw HTTP, on 127.0.0.1."""
import concurrent.futures as cf
import json

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from quantkit.models.embedded import embedded_model_dir
from quantkit.runtime.engine import Engine
from quantkit.serve.app import create_app
from quantkit.drafts.prompt_lookup import PromptLookupDrafter
from quantkit.testing.models import single_thread, tiny_llama

from helpers import ServerThread

NAME = "tiny"


class _Server(ServerThread):
    def __init__(self, engine, **kw):
        self.engine = engine
        super().__init__(create_app(engine, NAME, **kw), [engine])


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(embedded_model_dir())


@pytest.fixture(scope="module")
def model(tok):
    # A random model over the real tokenizer's vocabulary: real text in and out, seconds to build.
    return tiny_llama(vocab_size=len(tok), hidden=64, seed=5, max_positions=256)


@pytest.fixture(scope="module")
def server(model, tok):
    with single_thread():
        engine = Engine(model, tok, drafter_factory=lambda: PromptLookupDrafter(2), max_active=64, max_queue=64)
        s = _Server(engine, max_tokens_limit=128)
        yield s
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def test_openai_client_completions(client, server):
    r = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    pieces, finish, usage = [], None, None
    for chunk in client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=12, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == r.choices[0].text and finish == r.choices[0].finish_reason
    assert usage.completion_tokens == 12


def test_openai_client_chat(client, tok, model):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    # The prompt is the chat template applied to the messages.
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert r.usage.prompt_tokens == len(ids)
    pieces = []
    stream = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0, stream=True)
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        pieces.append(chunk.choices[0].delta.content or "")
    assert "".join(pieces) == r.choices[0].message.content


def test_stream_ends_with_done_and_carries_token_details(server):
    body = {"model": NAME, "prompt": "a b c a b c a b", "max_tokens": 16, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln]
        rid = r.headers["x-request-id"]
    assert lines[-1] == "data: [DONE]"
    tokens = [t for ln in lines[:-1] for t in json.loads(ln[6:]).get("quantkit_tokens", [])]
    assert len(tokens) == 16 and all({"text", "logprob", "drafted", "id"} <= set(t) for t in tokens)
    assert all(t["logprob"] <= 0 for t in tokens)
    details = httpx.get(f"{server.url}/v1/details/{rid}").json()
    assert [t["id"] for t in details["tokens"]] == [t["id"] for t in tokens]
    assert details["metrics"]["output_tokens"] == 16


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    text = httpx.get(server.url + "/metrics").text
    for name in ("quantkit_tokens_per_second", "quantkit_acceptance_rate", "quantkit_time_to_first_token_seconds",
                 "quantkit_time_per_output_token_seconds", "quantkit_tokens_per_target_forward",
                 "quantkit_mean_accepted_length"):
        assert f"# TYPE {name} gauge" in text
    assert float(text.split("\nquantkit_requests_total ")[1].split()[0]) >= 1


@pytest.mark.parametrize("raw,param", [
    (b"{not json", None),
    (json.dumps({"prompt": "hi", "max_tokens": 4}).encode(), "model"),
    (json.dumps({"model": NAME, "max_tokens": 4}).encode(), "prompt"),
    (json.dumps({"model": NAME, "prompt": "hi", "max_tokens": "four"}).encode(), "max_tokens"),
    (json.dumps({"model": NAME, "prompt": "hi", "temperature": "hot"}).encode(), "temperature"),
    (json.dumps({"model": NAME, "prompt": "word " * 400, "max_tokens": 4}).encode(), "prompt"),
    (json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 100000}).encode(), "max_tokens"),
    (json.dumps({"model": "gpt-4", "prompt": "hi", "max_tokens": 4}).encode(), "model"),
    (json.dumps([1, 2]).encode(), None),
])
def test_bad_requests_get_openai_style_400(server, raw, param):
    r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["message"] and (param is None or err["param"].startswith(param))
    # ... and the server keeps serving.
    ok = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_bad_chat_request(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": NAME, "messages": [{"role": "wizard"}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": NAME, "messages": []})
    assert r.status_code == 400


def test_32_concurrent_requests_equal_their_answers_alone(server):
    prompts = [f"Item {i}: the {w} of" for i, w in enumerate(["colour", "size", "shape", "smell"] * 8)]

    def ask(p):
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"model": NAME, "prompt": p, "max_tokens": 10, "temperature": 0})
        assert r.status_code == 200
        return r.json()["choices"][0]["text"]

    alone = [ask(p) for p in prompts]
    with cf.ThreadPoolExecutor(32) as pool:
        together = list(pool.map(ask, prompts))
    assert together == alone
    assert len(set(alone)) > 1  # different prompts, different answers: the comparison is not vacuous


def test_full_queue_answers_429(model, tok):
    with single_thread():
        engine = Engine(model, tok, max_active=1, max_queue=1)
        s = _Server(engine)
        try:
            def ask(_):
                return httpx.post(s.url + "/v1/completions", timeout=120, json={
                    "model": NAME, "prompt": "hello", "max_tokens": 60, "temperature": 0}).status_code

            with cf.ThreadPoolExecutor(6) as pool:
                codes = list(pool.map(ask, range(6)))
            assert 429 in codes and 200 in codes
            r = httpx.post(s.url + "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200
        finally:
            s.stop()
