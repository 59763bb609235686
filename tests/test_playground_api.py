"""The playground's HTTP side: page and assets, its config, the compare model's endpoints, and the KL endpoint
checked against a float64 reference. The browser side is in test_playground_browser.py."""
import copy
import json
import re
import time

import httpx
import pytest
import quantkit
import torch
from transformers import AutoTokenizer

from quantkit.errors import UserError
from quantkit.models.embedded import embedded_model_dir
from quantkit.runtime.engine import Engine
from quantkit.runtime.generate import generate
from quantkit.serve.playground import STATIC, CompareModel, mount
from quantkit.runtime.sampling import SamplingParams
from quantkit.serve.app import create_app
from quantkit.drafts.prompt_lookup import PromptLookupDrafter
from quantkit.testing.models import single_thread, tiny_llama

from helpers import ServerThread, free_port


_Server = ServerThread


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(embedded_model_dir())


@pytest.fixture(scope="module")
def models(tok):
    # init_std 0.2 makes the random models' next-token distributions peaked and different from each other,
    # so the KLs are far from zero (a near-uniform pair would give KLs too small to test anything).
    served = tiny_llama(vocab_size=len(tok), hidden=64, seed=11, init_std=0.2, max_positions=256)
    base = tiny_llama(vocab_size=len(tok), hidden=64, seed=12, init_std=0.2, max_positions=256)
    return served, base


@pytest.fixture(scope="module")
def server(models, tok):
    served, base = models
    with single_thread():
        # one-token matches on: a random model seldom repeats two tokens, and this test needs drafts
        main = Engine(served, tok, drafter_factory=lambda: PromptLookupDrafter(2, min_ngram=1))
        other = Engine(base, tok)
        app = create_app(main, "served", max_tokens_limit=64)
        mount(app, compare=CompareModel(other, "base"))
        s = _Server(app, [main, other])
        yield s
        s.stop()


def test_page_and_assets_are_served_and_self_contained(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert '<script src="/playground/app.js">' in r.text and "/playground/style.css" in r.text
    for name, kind in (("app.js", "javascript"), ("style.css", "text/css")):
        a = httpx.get(f"{server.url}/playground/{name}")
        assert a.status_code == 200 and kind in a.headers["content-type"]
        assert a.text == (STATIC / name).read_text()
    # Works offline: no file refers to another host (CDN, web font, analytics).
    for f in STATIC.iterdir():
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", f.read_text(), re.I), f.name
    assert httpx.get(server.url + "/playground/missing.js").status_code == 404


def test_config_names_both_models(server):
    cfg = httpx.get(server.url + "/v1/playground").json()
    assert cfg == {"model": "served", "compare": "base", "chat": True, "speculative": True,
                   "num_speculative_tokens": 4, "max_tokens_limit": 64, "default_max_tokens": 256}


def test_compare_endpoints_serve_the_base_model(server, models, tok):
    assert [m["id"] for m in httpx.get(server.url + "/compare/v1/models").json()["data"]] == ["base"]
    prompt = "The capital of France is"
    want = {}
    for name, model, prefix in (("served", models[0], ""), ("base", models[1], "/compare")):
        r = httpx.post(f"{server.url}{prefix}/v1/completions", timeout=60,
                       json={"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        with single_thread():
            want[name] = generate(model, tok(prompt)["input_ids"], SamplingParams(max_tokens=8), tokenizer=tok).text()
        assert r.json()["choices"][0]["text"] == want[name]
    assert want["served"] != want["base"]  # two different models really answered
    # Each app only knows its own model.
    r = httpx.post(server.url + "/compare/v1/completions", json={"model": "served", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def _reference_kl(served, base, ids, n_prompt):
    """Float64 KL(P_base || P_served) and logprobs per answer token, from float64 copies of both models."""
    out = []
    for m in (served, base):
        m64 = copy.deepcopy(m).double()
        with torch.no_grad():
            logits = m64(input_ids=torch.tensor([ids])).logits[0, n_prompt - 1:len(ids) - 1]
        out.append(logits.log_softmax(-1))
    lp_s, lp_b = out
    kl = (lp_b.exp() * (lp_b - lp_s)).sum(-1)
    tok_ids = torch.tensor(ids[n_prompt:]).unsqueeze(-1)
    return kl, lp_s.gather(-1, tok_ids).squeeze(-1), lp_b.gather(-1, tok_ids).squeeze(-1)


@pytest.mark.parametrize("chat", [False, True])
def test_kl_matches_float64_reference(server, models, tok, chat):
    g = torch.Generator().manual_seed(7)
    answer = torch.randint(0, len(tok), (12,), generator=g).tolist()
    if chat:
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
        body = {"messages": msgs}
        prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    else:
        body = {"prompt": "Once upon a time there was"}
        prompt = tok(body["prompt"])["input_ids"]
    r = httpx.post(server.url + "/v1/playground/kl", json={**body, "completion_ids": answer}, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["model"] == "served" and got["base"] == "base" and len(got["kl"]) == len(answer)
    kl, lp_s, lp_b = _reference_kl(*models, list(prompt) + answer, len(prompt))
    assert kl.min() > 0.05  # different models: the comparison below is not between zeros
    # The server works in float32: over 2 small layers the logits carry ~1e-6 relative error, and the KL sum
    # over 49k terms adds ~1e-6 more; 1e-4 relative (+1e-5 absolute) is far above that and far below the KLs.
    torch.testing.assert_close(torch.tensor(got["kl"], dtype=torch.float64), kl, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor(got["model_logprob"], dtype=torch.float64), lp_s, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor(got["base_logprob"], dtype=torch.float64), lp_b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "completion_ids": [1, 2]}, None),  # control: valid
    ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "completion_ids": [1]}, "prompt"),
    ({"completion_ids": [1]}, "prompt"),
    ({"prompt": "hi", "completion_ids": []}, None),
    ({"prompt": "hi", "completion_ids": [10 ** 6]}, "completion_ids"),
    ({"prompt": "hi", "completion_ids": ["a"]}, None),
    ({"prompt": "hi", "completion_ids": [1] * 300}, "completion_ids"),
])
def test_kl_bad_requests(server, body, param):
    r = httpx.post(server.url + "/v1/playground/kl", json=body, timeout=60)
    if body == {"prompt": "hi", "completion_ids": [1, 2]}:
        assert r.status_code == 200
        return
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and (param is None or err["param"] == param)


def test_without_compare_there_is_no_kl_and_no_compare_app(models, tok):
    with single_thread():
        engine = Engine(models[0], tok)
        app = create_app(engine, "solo")
        mount(app)
        s = _Server(app, [engine])
    try:
        assert httpx.get(s.url + "/v1/playground").json()["compare"] is None
        r = httpx.post(s.url + "/v1/playground/kl", json={"prompt": "hi", "completion_ids": [1]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "no_compare_model"
        assert httpx.get(s.url + "/compare/v1/models").status_code == 404
        assert httpx.get(s.url + "/").status_code == 200
    finally:
        s.stop()


def test_compare_needs_the_same_vocabulary(models, tok):
    other = tiny_llama(vocab_size=512, hidden=64, seed=1)
    engine, base = Engine(models[0], tok), Engine(other, tok)
    try:
        app = create_app(engine, "a")
        with pytest.raises(UserError, match="same tokenizer"):
            mount(app, compare=CompareModel(base, "b"))
    finally:
        engine.close()
        base.close()


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tok):
    """Two tiny models saved with the real tokenizer (the served one and its base), and one with another vocab."""
    out = {}
    for name, vocab, seed in (("quant", len(tok), 21), ("base", len(tok), 22), ("other", 300, 23)):
        path = tmp_path_factory.mktemp(name)
        tiny_llama(vocab_size=vocab, seed=seed, max_positions=256).save_pretrained(path)
        tok.save_pretrained(path)
        out[name] = path
    return out


def test_cli_serve_compare_serves_the_playground_and_both_models(folders):
    import subprocess
    import sys

    port = free_port()
    # Importing serve_cmd registers the command even where cli._register does not list it yet.
    code = "import quantkit.cli.serve_cmd; from quantkit.cli import main; main()"
    args = ["serve", str(folders["quant"]), "--compare", str(folders["base"]), "--prompt-lookup", "2",
            "--port", str(port), "--model-name", "q"]
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "quantkit serve did not come up"
            time.sleep(0.3)
        assert "<title>quantkit playground</title>" in httpx.get(url + "/").text
        cfg = httpx.get(url + "/v1/playground").json()
        assert cfg["model"] == "q" and cfg["compare"] == folders["base"].name and cfg["speculative"]
        assert [m["id"] for m in httpx.get(url + "/compare/v1/models").json()["data"]] == [folders["base"].name]
        r = httpx.post(url + "/v1/playground/kl", json={"prompt": "hello", "completion_ids": [5, 6, 7]}, timeout=60)
        assert r.status_code == 200 and len(r.json()["kl"]) == 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_cli_serve_refuses_a_base_with_another_vocabulary(folders):
    from typer.testing import CliRunner

    # Registering two commands keeps typer in sub-command mode even where cli._register lists neither yet.
    import quantkit.cli.generate_cmd  # noqa: F401
    import quantkit.cli.serve_cmd  # noqa: F401
    from quantkit.cli import app

    r = CliRunner().invoke(app, ["serve", str(folders["quant"]), "--compare", str(folders["other"])])
    assert isinstance(r.exception, UserError) and "same tokenizer" in str(r.exception)


def test_stream_chunks_carry_running_speculation_totals(server):
    body = {"model": "served", "prompt": "a b c a b c a b", "max_tokens": 64,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        rid = r.headers["x-request-id"]
    totals = [c["quantkit_metrics"] for c in chunks if "quantkit_tokens" in c]
    assert totals and all(set(t) == {"drafted", "accepted", "spec_steps"} for t in totals)
    for key in ("drafted", "accepted", "spec_steps"):
        assert all(a[key] <= b[key] for a, b in zip(totals, totals[1:]))  # running totals never go back
    final = httpx.get(f"{server.url}/v1/details/{rid}").json()["metrics"]
    assert totals[-1] == {k: final[k] for k in ("drafted", "accepted", "spec_steps")} and final["drafted"] > 0


def test_compare_base_is_compiled_with_the_served_model(folders, monkeypatch):
    """`serve --compile --compare BASE`: the base decodes through compiled steps too, so their speeds compare;
    a base whose Linears hold float16 weights with float32 products (FBGEMM) or are left as nn.Linear (here a
    float16 base where FBGEMM is made unavailable) compiles; one in oneDNN's float32 layout stays eager, where
    those products are faster than a compiled graph."""
    from quantkit.linear import half_weight as half_weight_linear
    from quantkit.linear.half_weight import HalfWeightLinear
    from quantkit.linear.packed import PackedLinear
    from quantkit.runtime import build, compiled
    from quantkit.runtime.engine import Engine
    from quantkit.serve.playground import load_compare

    served = quantkit.load(str(folders["quant"]))
    engine = Engine(served, build.load_tokenizer(str(folders["quant"])))
    try:
        relaid = load_compare(str(folders["base"]), engine, dtype=torch.float16, compile_=True)
        packed = load_compare(str(folders["base"]), engine, compile_=True)
        half = half_weight_linear.available()
        monkeypatch.setattr(half_weight_linear, "available", lambda: False)
        plain = load_compare(str(folders["base"]), engine, dtype=torch.float16)
        fast = load_compare(str(folders["base"]), engine, dtype=torch.float16, compile_=True)
        assert compiled.step(plain.engine.model, "slot") is None
        assert compiled.step(fast.engine.model, "slot") is not None
        # the float32 base holds arbitrary float32 values: oneDNN's layout, eager
        assert isinstance(packed.engine.model.model.layers[0].mlp.up_proj, PackedLinear)
        assert compiled.step(packed.engine.model, "slot") is None
        # the float16 base is held by FBGEMM where torch has it (x86), and compiles either way
        assert isinstance(relaid.engine.model.model.layers[0].mlp.up_proj, HalfWeightLinear) == half
        assert compiled.step(relaid.engine.model, "slot") is not None
        for c in (plain, fast, packed, relaid):
            c.engine.close()
    finally:
        engine.close()
