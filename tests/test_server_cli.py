"""`quantkit serve` start-up: bad ports and taken ports are one line and exit 2 (the socket is bound before
anything is printed or loaded), an open --host without a key warns, the key can come from QUANTKIT_API_KEY,
and the settings reach the app."""
import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from quantkit.cli import serve_cmd
from quantkit.testing.models import tiny_llama

from helpers import free_port
from serve_helpers import real_tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tok = real_tokenizer()
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(vocab_size=len(tok), seed=9, max_positions=256).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def served(monkeypatch):
    """Replaces the serving loop: records what would be served, on which socket."""
    seen = {}

    def fake_run(engine, base, name, config, sock):
        seen.update(name=name, config=config, port=sock.getsockname()[1])
        sock.close()
        engine.close()

    monkeypatch.setattr(serve_cmd, "run", fake_run)
    return seen


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_a_port_out_of_range_is_one_line(cli, port):
    code, out, err = cli("serve", "no-such-model", "--port", port)
    assert code == 2 and out == ""
    assert "--port must be between 0 and 65535" in _one_error_line(err)


def test_a_taken_port_is_one_line_before_loading_anything(cli, folder):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = cli("serve", str(folder), "--port", port)
    line = _one_error_line(err)
    assert code == 2 and out == "" and f"127.0.0.1:{port}" in line and "--port" in line
    assert "serving" not in err


def test_serving_is_printed_after_the_bind_with_the_real_port(cli, folder, served):
    code, out, err = cli("serve", str(folder), "--port", "0", "--model-name", "m")
    assert code == 0, err
    assert served["port"] != 0 and f"serving 'm' on http://127.0.0.1:{served['port']}/v1" in err


def test_an_open_host_without_a_key_warns(cli, monkeypatch):
    monkeypatch.delenv("QUANTKIT_API_KEY", raising=False)
    port = free_port()
    code, _, err = cli("serve", "no-such-model", "--host", "0.0.0.0", "--port", port)
    assert code == 2 and "is not a model folder" in err  # the warning came first, at start-up
    assert f"warning: --host 0.0.0.0 accepts connections from other machines and no --api-key is set" in err
    assert "QUANTKIT_API_KEY" in err
    for args, env in ((["--api-key", "k"], None), ([], "k")):
        if env:
            monkeypatch.setenv("QUANTKIT_API_KEY", env)
        code, _, err = cli("serve", "no-such-model", "--host", "0.0.0.0", "--port", port, *args)
        assert code == 2 and "warning" not in err
    monkeypatch.delenv("QUANTKIT_API_KEY")
    code, _, err = cli("serve", "no-such-model", "--port", port)  # loopback: no warning needed
    assert code == 2 and "warning" not in err


def test_settings_reach_the_app(cli, folder, served, monkeypatch):
    monkeypatch.setenv("QUANTKIT_API_KEY", "from-env")
    code, _, err = cli("serve", str(folder), "--port", "0", "--allowed-hosts", "a.example,b.example",
                       "--allowed-hosts", "c.example", "--allowed-origins", "http://ok.example",
                       "--max-body-bytes", "4096", "--clamp-max-tokens")
    assert code == 0, err
    c = served["config"]
    assert c.api_key == "from-env" and c.allowed_hosts == ("a.example", "b.example", "c.example")
    assert c.allowed_origins == ("http://ok.example",) and c.max_body_bytes == 4096 and c.clamp_max_tokens
    code, _, err = cli("serve", str(folder), "--port", "0", "--max-body-bytes", "0")
    assert code == 2 and "--max-body-bytes must be at least 1" in _one_error_line(err)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_answers_what_is_in_flight_then_stops_on_a_signal(folder, signum):
    """The engine's loop runs on the main thread and HTTP on another (cli/serve_cmd.run). SIGTERM (a service
    manager's stop) or SIGINT (Ctrl-C) while a streamed answer is under way: that answer still arrives whole, then
    the process ends with status 0."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "quantkit", "serve", str(folder), "--port", str(port),
                             "--model-name", "m"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
                time.sleep(0.2)
        body = {"model": "m", "prompt": "Hello", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        events = []
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        proc.send_signal(signum)
        assert events[-1] == "[DONE]"
        usage = [json.loads(e)["usage"] for e in events[:-1] if json.loads(e).get("usage")]
        assert usage and usage[-1]["completion_tokens"] == 200, events[-3:]
        assert proc.wait(timeout=30) == 0, proc.stderr.read()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
