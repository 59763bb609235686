"""Shared pieces of the server tests (tests/test_server*.py): a tiny random llama over the real tokenizer, the
real app served by uvicorn on 127.0.0.1, and checks that a request left nothing behind."""
from __future__ import annotations

import time

import httpx
import torch

from quantkit.runtime import llama_step
from quantkit.runtime.engine import Engine
from quantkit.testing.models import tiny_llama
from quantkit.serve.app import create_app

from helpers import ServerThread

NAME = "tiny"


def real_tokenizer():
    from transformers import AutoTokenizer

    from quantkit.models.embedded import embedded_model_dir

    return AutoTokenizer.from_pretrained(embedded_model_dir())


def random_model(tok, seed: int = 5, init_std: float = 0.02):
    # A random model over the real tokenizer's vocabulary: real text in and out, seconds to build.
    return tiny_llama(vocab_size=len(tok), hidden=64, seed=seed, max_positions=256, init_std=init_std)


class Served(ServerThread):
    """create_app(engine, NAME, **settings) served on 127.0.0.1; `stop()` also closes the engine."""

    def __init__(self, model, tok, engine_kw: dict | None = None, app_hook=None, **settings):
        self.engine = Engine(model, tok, **(engine_kw or {}))
        self.app = create_app(self.engine, NAME, **settings)
        if app_hook is not None:
            app_hook(self.app)
        super().__init__(self.app, [self.engine])

    def post(self, path: str, body=None, *, content: bytes | None = None, headers=None, timeout=60,
             client: httpx.Client | None = None):
        hdr = {"content-type": "application/json", **(headers or {})}
        return (client or httpx).post(self.url + path, json=body if content is None else None, content=content,
                                      headers=hdr, timeout=timeout)

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"no metric {name}")


def wait_idle(engine: Engine, timeout: float = 10.0) -> None:
    """Until the engine decodes nothing, holds nothing in its queue and every KV slot is free again."""
    pool = llama_step.pool_for(engine.model)
    deadline = time.time() + timeout
    while True:
        with engine._cv:
            busy = len(engine._waiting) + len(engine._active)
        if busy == 0 and pool.n_live() == 0:
            return
        assert time.time() < deadline, f"engine still busy after {timeout}s: {busy} requests, {pool.n_live()} slots"
        time.sleep(0.02)


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    """An OpenAI-style error body with this status (param: the start of the param it names)."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param), err
    if code is not None:
        assert err["code"] == code, err
    return err


def forward_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] float32 log-softmax of one plain transformers forward over ids (row j predicts j + 1)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float().log_softmax(-1)


def forward_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
