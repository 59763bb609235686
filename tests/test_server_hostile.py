"""Issue 37.5: sampling parameters that would leave no token, 400 messages in the API's terms, and a model
that computes NaN: a 500 with an OpenAI body naming the request, never invalid JSON, and the server serves on."""
from __future__ import annotations

import copy
import json

import httpx
import pytest
import torch

from quantkit.testing.models import single_thread

from serve_fixtures import model, server, tok  # noqa: F401  (fixtures)
from serve_helpers import NAME, Served, assert_error, wait_idle

POISON = 7  # the token whose embedding row the damaged model holds as NaN


def _body(**kw):
    return {"model": NAME, "prompt": "Once upon", "max_tokens": 6, **kw}


@pytest.mark.parametrize("top_p", [1e-300, 1e-46, 1e-40])
def test_top_p_below_float32s_smallest_number_is_greedy(server, top_p):
    """top_p 1e-300 passed validation, rounded to 0 in float32 and dropped every token: a 500."""
    greedy = server.post("/v1/completions", _body(temperature=0)).json()["choices"][0]["text"]
    r = server.post("/v1/completions", _body(temperature=1.0, top_p=top_p, seed=3))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy
    streamed = server.post("/v1/completions", _body(temperature=1.0, top_p=top_p, stream=True))
    assert streamed.status_code == 200 and '"error"' not in streamed.text and streamed.text.endswith("[DONE]\n\n")


@pytest.mark.parametrize("kw, param, words", [
    ({"stop": ["x"] * 100}, "stop", "at most 16 items"),
    ({"stop": ["a", "x" * 1001]}, "stop.1", "at most 1000 characters"),
    ({"prompt": [1, -2]}, "prompt.1", "greater than or equal to 0"),
])
def test_400_names_the_api_field_not_a_validator(server, kw, param, words):
    """stop with 100 entries was refused as 'stop.constrained-str: Input should be a valid string'."""
    err = assert_error(server.post("/v1/completions", _body(**kw)), 400, code="invalid_value")
    assert err["param"] == param and words in err["message"] and "constrained" not in err["message"], err


@pytest.fixture(scope="module")
def poisoned(model, tok):
    """The served model with one token's embedding NaN: any prompt holding that token computes NaN logits."""
    bad = copy.deepcopy(model)
    with torch.no_grad():
        if bad.get_output_embeddings().weight is bad.get_input_embeddings().weight:
            bad.lm_head.weight = torch.nn.Parameter(bad.lm_head.weight.clone(), requires_grad=False)
        bad.get_input_embeddings().weight[POISON] = float("nan")
    with single_thread():
        s = Served(bad, tok)
        yield s
        s.stop()


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2}, {"temperature": 1.0}])
def test_nan_logits_are_a_500_naming_the_request(poisoned, extra):
    """One NaN in the weights: 200 with '' (greedy), or a 500 'Out of range float values are not JSON
    compliant' (logprobs), or a failed multinomial draw (sampling)."""
    r = poisoned.post("/v1/completions", _body(prompt=[5, POISON, 9], **extra))
    err = assert_error(r, 500)
    assert err["type"] == "server_error" and "non-finite logits" in err["message"] and "(request " in err["message"]
    ok = poisoned.post("/v1/completions", _body(prompt=[5, 6, 9], logprobs=2))
    assert ok.status_code == 200 and json.loads(ok.text)["choices"][0]["text"]
    wait_idle(poisoned.engine)


def test_nan_logits_while_streaming_end_in_an_error_event(poisoned):
    r = poisoned.post("/v1/completions", _body(prompt=[5, POISON], stream=True, logprobs=1))
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]  # every event is valid JSON: no NaN
    assert err["type"] == "server_error" and "non-finite logits" in err["message"]
    assert httpx.get(poisoned.url + "/health").status_code == 200
