"""Parameters that change what an answer means: logprobs / top_logprobs (checked against a plain forward of
the model), echo, logit_bias and presence/frequency penalties (checked against a hand computation of OpenAI's
definitions), and a 400 naming each parameter the server cannot honour."""
import json

import httpx
import openai
import pytest
import torch

from quantkit.drafts.prompt_lookup import PromptLookupDrafter
from quantkit.testing.models import single_thread

from serve_helpers import NAME, Served, assert_error, forward_logits, random_model, real_tokenizer

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"


@pytest.fixture(scope="module")
def tok():
    return real_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    # init_std 0.2: peaked next-token distributions, so greedy choices have clear margins over float noise
    return random_model(tok, seed=7, init_std=0.2)


@pytest.fixture(scope="module")
def server(model, tok):
    with single_thread():
        s = Served(model, tok, engine_kw={"drafter_factory": lambda: PromptLookupDrafter(2, min_ngram=1)})
        yield s
        s.stop()


def complete(server, **kw) -> tuple[dict, list[int]]:
    """A completion (of PROMPT unless kw says otherwise) and its token ids (from /v1/details)."""
    r = server.post("/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    body = r.json()
    details = httpx.get(server.url + body["quantkit"]["details"]).json()
    return body, [t["id"] for t in details["tokens"]]


def step_logits(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    """[len(out), V]: the logits each output token was chosen from, from one teacher-forced forward."""
    return forward_logits(model, prompt + out)[len(prompt) - 1:len(prompt) - 1 + len(out)]


def close(a, b):
    torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                               rtol=1e-4, atol=1e-4)


def test_completion_logprobs_are_the_models_under_greedy(server, model, tok):
    body, out = complete(server, logprobs=3)
    lp = step_logits(model, tok(PROMPT)["input_ids"], out).log_softmax(-1)
    got = body["choices"][0]["logprobs"]
    assert got["tokens"] == [tok.decode([t]) for t in out]
    close(got["token_logprobs"], lp.gather(-1, torch.tensor(out)[:, None])[:, 0])
    for i, top in enumerate(got["top_logprobs"]):
        want = torch.topk(lp[i], 3)
        # the three most likely tokens, and the chosen one (greedy: it is the first of them)
        assert list(top)[:3] == [tok.decode([j]) for j in want.indices.tolist()]
        close(list(top.values())[:3], want.values)
    offsets = got["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(body["choices"][0]["text"])
    assert complete(server)[1] == out  # the same answer as without logprobs


def test_logprobs_and_penalties_decode_without_a_drafter(server):
    seqs, real = [], server.engine.submit
    server.engine.submit = lambda seq, on_event: seqs.append(seq) or real(seq, on_event)
    try:
        complete(server, logprobs=1)
        complete(server, frequency_penalty=0.5)
        complete(server, logit_bias={"5": 1})
        complete(server)
    finally:
        server.engine.submit = real
    # one-token steps follow each step's own distribution (runtime/processed.py); plain requests still draft
    assert [s.drafter is None for s in seqs] == [True, True, True, False]


@pytest.mark.parametrize("top_p", [1.0, 0.3])
def test_sampled_logprobs_are_of_the_distribution_sampled_from(server, model, tok, top_p):
    body, out = complete(server, logprobs=2, temperature=0.7, top_p=top_p, seed=3)
    logits = step_logits(model, tok(PROMPT)["input_ids"], out) / 0.7
    if top_p < 1.0:  # the nucleus, renormalised: a token is dropped once the mass before it reaches top_p
        p = logits.softmax(-1)
        sp, idx = p.sort(-1, descending=True)
        drop = (sp.cumsum(-1) - sp) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
    lp = logits.log_softmax(-1)
    got = body["choices"][0]["logprobs"]
    close(got["token_logprobs"], lp.gather(-1, torch.tensor(out)[:, None])[:, 0])
    for i, top in enumerate(got["top_logprobs"]):
        want = torch.topk(lp[i], 2).values.clamp_min(-9999.0)  # JSON has no -inf; vLLM's floor
        close(sorted(top.values(), reverse=True)[:2], want)


def test_chat_logprobs_in_openais_shape(server, model, tok):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    msgs = [{"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    details = httpx.get(f"{server.url}/v1/details/{r.id.removeprefix('chatcmpl-')}").json()
    out = [t["id"] for t in details["tokens"]]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    lp = step_logits(model, list(prompt), out).log_softmax(-1)
    assert [c.token for c in content] == [tok.decode([t]) for t in out]
    assert all(c.bytes == list(c.token.encode()) and len(c.top_logprobs) == 2 for c in content)
    close([c.logprob for c in content], lp.gather(-1, torch.tensor(out)[:, None])[:, 0])
    close([[t.logprob for t in c.top_logprobs] for c in content], torch.topk(lp, 2).values)
    plain = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content


def test_streamed_logprobs_equal_the_whole_answers(server):
    body, _ = complete(server, logprobs=2)
    parts = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    req = {"model": NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 2, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=req, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                lp = json.loads(line[6:])["choices"][0]["logprobs"]
                for k in parts:
                    parts[k] += lp[k] if lp else []
    assert parts == body["choices"][0]["logprobs"]


@pytest.mark.parametrize("prompt", [PROMPT, PROMPT * 12], ids=["short", "past-one-chunk"])
def test_echo_returns_the_prompt_and_its_logprobs(server, model, tok, prompt):
    plain, out = complete(server, prompt=prompt)
    echoed, _ = complete(server, prompt=prompt, echo=True, logprobs=1)
    assert echoed["choices"][0]["text"] == prompt + plain["choices"][0]["text"]
    ids = tok(prompt)["input_ids"]
    assert len(ids) > 64 or prompt == PROMPT  # the long one is prefilled in several chunks (processed.py)
    got = echoed["choices"][0]["logprobs"]
    assert got["tokens"][:len(ids)] == [tok.decode([t]) for t in ids] and got["token_logprobs"][0] is None
    lp = forward_logits(model, ids + out).log_softmax(-1)
    want = lp[:-1].gather(-1, torch.tensor(ids + out)[1:, None])[:, 0]
    close(got["token_logprobs"][1:], want)
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "model": NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, "echo": True, "stream": True}) as r:
        texts = [json.loads(ln[6:])["choices"][0]["text"] for ln in r.iter_lines() if ln.startswith("data: {")]
    assert texts[0] == prompt and "".join(texts) == echoed["choices"][0]["text"]


def hand_greedy(model, prompt, n, bias=None, presence=0.0, frequency=0.0):
    """OpenAI's definitions, one token at a time: mu[j] - c[j] * frequency - (c[j] > 0) * presence + bias[j]."""
    out, lps = [], []
    for _ in range(n):
        mu = forward_logits(model, prompt + out)[-1].double()
        c = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=mu.shape[0]).double()
        mu = mu - c * frequency - (c > 0).double() * presence
        for j, b in (bias or {}).items():
            mu[j] += b
        out.append(int(mu.argmax()))
        lps.append(float(mu.log_softmax(-1)[out[-1]]))
    return out, lps


T = 1234  # a token the bias makes likely, so that it repeats and the penalties have counts to act on


@pytest.mark.parametrize("bias,presence,frequency", [
    ({T: 9.1}, 0.0, 2.0), ({T: 7.5}, 2.0, 0.0), ({T: 7.0}, -0.5, 0.7), ({T: 100.0}, 0.0, 0.0), ("off", 0.0, 0.0),
])
def test_penalties_and_logit_bias_follow_openai(server, model, tok, bias, presence, frequency):
    prompt = tok(PROMPT)["input_ids"]
    base, _ = hand_greedy(model, prompt, 10)
    if bias == "off":  # the favourite is forbidden, the next one made less likely
        bias = {base[0]: -100.0, base[1]: -3.5}
    want, want_lp = hand_greedy(model, prompt, 10, bias, presence, frequency)
    # each parameter changes the answer: the comparison is not vacuous
    assert want != base and (presence == frequency == 0 or want != hand_greedy(model, prompt, 10, bias)[0])
    body, out = complete(server, max_tokens=10, logprobs=0, logit_bias={str(k): v for k, v in bias.items()},
                         presence_penalty=presence, frequency_penalty=frequency)
    assert out == want
    close(body["choices"][0]["logprobs"]["token_logprobs"], want_lp)


BAD = [("best_of", 2), ("suffix", "tail"), ("tools", [{"type": "function", "function": {"name": "f"}}]),
       ("tool_choice", "required"), ("functions", [{"name": "f"}]), ("function_call", {"name": "f"}),
       ("response_format", {"type": "json_object"}), ("response_format", {"type": "json_schema"}),
       ("audio", {"voice": "x"}), ("modalities", ["text", "audio"]), ("n", 2), ("best_of", True),
       ("logprobs", 21), ("logit_bias", {"abc": 1}), ("logit_bias", {"10000000": 1}), ("logit_bias", {"5": 101}),
       ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 1.1), ("foo", 1)]


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v}" for n, v in BAD])
def test_what_cannot_be_honoured_is_a_400_naming_it(server, name, value):
    r = server.post("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2, name: value})
    err = assert_error(r, 400, name)
    assert name in err["message"]


def test_chat_only_parameters(server):
    msgs = [{"role": "user", "content": "hi"}]
    r = server.post("/v1/chat/completions", {"model": NAME, "messages": msgs, "top_logprobs": 2})
    assert_error(r, 400, "top_logprobs")
    r = server.post("/v1/chat/completions", {"model": NAME, "messages": msgs, "echo": True})
    assert_error(r, 400, "echo", "unknown_parameter")


@pytest.mark.parametrize("name,value", [("best_of", 1), ("suffix", ""), ("tools", []), ("tool_choice", "none"),
                                        ("response_format", {"type": "text"}), ("user", "u1"), ("n", 1)])
def test_values_that_ask_for_nothing_more_are_accepted(server, name, value):
    r = server.post("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2, name: value})
    assert r.status_code == 200, r.text
