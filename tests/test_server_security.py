"""The server's guards (quantkit/serve/security.py, docs/security.md): API key, Host header, CORS, JSON-only bodies."""
import json
import shutil
import subprocess

import httpx
import pytest

from quantkit.runtime.engine import Engine
from quantkit.testing.models import single_thread
from quantkit.serve import security
from quantkit.serve.playground import STATIC, CompareModel, mount

from serve_helpers import NAME, Served, assert_error, random_model
from serve_fixtures import model, tok  # noqa: F401  (fixtures)

KEY = "s3cret-ключ"  # not ASCII: the comparison must work on bytes
AUTH = {"Authorization": "Bearer " + KEY}


@pytest.fixture(scope="module")
def keyed(model, tok):
    """A server with an API key, the playground and a compare app mounted."""
    base = Engine(random_model(tok, seed=6), tok)
    with single_thread():
        s = Served(model, tok, api_key=KEY, app_hook=lambda app: mount(app, compare=CompareModel(base, "base")))
        s.engines.append(base)
        yield s
        s.stop()


@pytest.fixture(scope="module")
def plain(model, tok):
    with single_thread():
        s = Served(model, tok)
        yield s
        s.stop()


V1 = [("GET", "/v1/models", None), ("GET", "/v1/details/nope", None), ("GET", "/v1/playground", None),
      ("GET", "/compare/v1/models", None), ("GET", "/v1/unknown", None),
      ("POST", "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2}),
      ("POST", "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
      ("POST", "/compare/v1/completions", {"model": "base", "prompt": "hi", "max_tokens": 2}),
      ("POST", "/v1/playground/kl", {"prompt": "hi", "completion_ids": [1, 2]})]


@pytest.mark.parametrize("method,path,body", V1, ids=[p for _, p, _ in V1])
def test_every_v1_route_needs_the_key(keyed, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic " + KEY}):
        hdr = {k: v.encode() for k, v in headers.items()}
        r = httpx.request(method, keyed.url + path, json=body, headers=hdr, timeout=60)
        err = assert_error(r, 401, code="invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer" and "Authorization: Bearer" in err["message"]
    r = httpx.request(method, keyed.url + path, json=body, headers={k: v.encode() for k, v in AUTH.items()},
                      timeout=60)
    assert r.status_code != 401 and r.status_code < 500, r.text


def test_the_page_health_and_metrics_need_no_key(keyed):
    for path in ("/", "/playground/app.js", "/playground/api.js", "/health", "/metrics"):
        assert httpx.get(keyed.url + path).status_code == 200, path


def test_the_key_is_compared_in_constant_time(keyed, monkeypatch):
    seen = []
    real = security.hmac.compare_digest
    monkeypatch.setattr(security.hmac, "compare_digest", lambda a, b: seen.append((a, b)) or real(a, b))
    httpx.get(keyed.url + "/v1/models", headers={"Authorization": b"Bearer guess"})
    assert seen == [(b"guess", KEY.encode())]


@pytest.mark.parametrize("host,ok", [
    ("127.0.0.1", True), ("127.0.0.1:8000", True), ("localhost:1", True), ("LOCALHOST", True), ("[::1]:8000", True),
    ("evil.example", False), ("evil.example:8000", False), ("127.0.0.1.evil.example", False), ("localhost.evil", False),
])
def test_host_header_must_name_the_loopback_server(plain, host, ok):
    r = httpx.get(plain.url + "/v1/models", headers={"Host": host})
    if ok:
        assert r.status_code == 200
    else:
        assert_error(r, 400, "host", "host_not_allowed")
        # a rebinding page cannot read the page or the metrics either
        assert httpx.get(plain.url + "/metrics", headers={"Host": host}).status_code == 400


def test_allowed_hosts_add_names(model, tok):
    with single_thread():
        s = Served(model, tok, allowed_hosts=("my.box",))
    try:
        assert httpx.get(s.url + "/health", headers={"Host": "my.box:8000"}).status_code == 200
        assert httpx.get(s.url + "/health", headers={"Host": "other.box"}).status_code == 400
    finally:
        s.stop()


def test_allowed_host_names():
    assert security.allowed_host_names("0.0.0.0") is None  # every address: names cannot be known
    assert security.allowed_host_names("::", ("a.example",)) == {"a.example"}
    assert security.allowed_host_names("127.0.0.1", ("*",)) is None
    assert security.allowed_host_names("10.1.2.3") == {"10.1.2.3"}
    assert security.allowed_host_names("localhost") == {"localhost", "127.0.0.1", "::1"}
    assert security.host_name("[::1]:80") == "::1" and security.host_name("Example.COM.:443") == "example.com"


def test_cors_is_off_by_default(plain):
    origin = {"Origin": "http://evil.example"}
    r = httpx.post(plain.url + "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 1},
                   headers=origin)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    pre = httpx.options(plain.url + "/v1/completions", headers={**origin, "Access-Control-Request-Method": "POST",
                                                                 "Access-Control-Request-Headers": "content-type"})
    assert "access-control-allow-origin" not in pre.headers and pre.status_code >= 400


def test_allowed_origins_turn_cors_on_for_them_only(model, tok):
    with single_thread():
        s = Served(model, tok, allowed_origins=("http://ok.example",))
    try:
        ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
        good = httpx.options(s.url + "/v1/completions", headers={"Origin": "http://ok.example", **ask})
        assert good.status_code == 200 and good.headers["access-control-allow-origin"] == "http://ok.example"
        bad = httpx.options(s.url + "/v1/completions", headers={"Origin": "http://evil.example", **ask})
        assert "access-control-allow-origin" not in bad.headers
    finally:
        s.stop()


@pytest.mark.parametrize("kind", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                  "multipart/form-data; boundary=x", None])
def test_a_simple_cross_origin_post_is_refused_before_any_work(plain, kind):
    before = plain.metric("quantkit_requests_total")
    body = json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 2}).encode()
    headers = {"Origin": "http://evil.example"} | ({"Content-Type": kind} if kind else {})
    r = httpx.post(plain.url + "/v1/completions", content=body, headers=headers)
    assert_error(r, 415, code="unsupported_media_type")
    assert plain.metric("quantkit_requests_total") == before
    ok = httpx.post(plain.url + "/v1/completions", content=body,
                    headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_the_page_asks_for_the_key_on_401_and_sends_it(tmp_path):
    """api.js under node, with a fake fetch that wants the key: one prompt, the key kept for later requests."""
    script = tmp_path / "run.js"
    script.write_text(f"""
const store = {{}}, asked = [], seen = [];
global.window = {{ sessionStorage: {{ getItem: (k) => store[k] ?? null, setItem: (k, v) => {{ store[k] = v; }} }},
                  prompt: (text) => {{ asked.push(text); return " {KEY} "; }} }};
global.fetch = async (path, opts) => {{
  seen.push([path, opts.headers.Authorization || null, opts.method || "GET"]);
  return {{ status: opts.headers.Authorization === "Bearer {KEY}" ? 200 : 401 }};
}};
require({json.dumps(str(STATIC / "api.js"))});
(async () => {{
  const a = await window.quantkitApi.request("/v1/playground");
  const b = await window.quantkitApi.postJSON("/v1/completions", {{ prompt: "x" }});
  console.log(JSON.stringify({{ statuses: [a.status, b.status], asked: asked.length, seen }}));
}})();
""")
    assert shutil.which("node"), "this test runs the page's api.js under node: install nodejs"
    out = json.loads(subprocess.run(["node", str(script)], capture_output=True, text=True, check=True).stdout)
    assert out["statuses"] == [200, 200] and out["asked"] == 1
    assert out["seen"] == [["/v1/playground", None, "GET"], ["/v1/playground", "Bearer " + KEY, "GET"],
                           ["/v1/completions", "Bearer " + KEY, "POST"]]
