"""The browser playground served at `/`, and the compare feature (`quantkit serve QUANT --compare BASE`).

The page (static/index.html, api.js, app.js, style.css: no build step, nothing fetched from elsewhere) talks only
to the server's own OpenAI-compatible endpoints, reading the per-token details each streamed chunk carries
(`quantkit_tokens`: text, logprob, drafted). `mount` adds:

- `GET /` and `/playground/*`: the page and its files (open without the API key, so the page can ask for it);
- `GET /v1/playground`: what the page needs to know (model names, speculation on or off, limits);
- with a compare model: its own OpenAI endpoints under `/compare/v1/...` (a second app over a second engine,
  so the two answers stream side by side), and `POST /v1/playground/kl`: per-token KL(P_base || P_served)
  along one answer, from one teacher-forced forward of each model over prompt + answer.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from ..errors import UserError
from ..runtime.sequence import context_limit
from ..drafts.model_draft import vocab_rows
from .chat import template_ids
from .protocol import APIError, Message, StrictModel, load_json, validate

STATIC = Path(__file__).parent / "static"


@dataclass
class CompareModel:
    """The base model the served one is compared with: its own engine, and the name clients send for it."""

    engine: object  # runtime.engine.Engine
    name: str


class KLBody(StrictModel):
    # The prompt in the same shape the completion or chat request had, so it is tokenised the same way.
    prompt: str | None = None
    messages: list[Message] | None = None
    completion_ids: list[int] = Field(min_length=1)


def check_same_vocab(model, base, tokenizer, base_tokenizer) -> None:
    """Token-by-token comparison needs token ids that mean the same thing in both models."""
    mv, bv = vocab_rows(model), vocab_rows(base)
    if mv != bv or tokenizer.get_vocab() != base_tokenizer.get_vocab():
        raise UserError(f"--compare needs the same tokenizer for both models (vocabularies of {mv} and {bv} "
                        "tokens differ); compare a checkpoint with the model it was quantised from")


def prompt_ids(tokenizer, prompt: str | None, messages: list[Message] | None) -> list[int]:
    """Token ids of a completion prompt or chat messages, as the completion endpoints build them."""
    if (prompt is None) == (messages is None):
        raise APIError("give exactly one of 'prompt' or 'messages'", param="prompt", code="invalid_value")
    if prompt is not None:
        return list(tokenizer(prompt)["input_ids"])
    return template_ids(tokenizer, messages)


@torch.inference_mode()
def _answer_logprobs(model, ids: list[int], n_prompt: int) -> torch.Tensor:
    """[n_answer, V] float32 log-probabilities the model gives each answer position, teacher-forced."""
    logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    # Row j predicts token j+1, so answer token i (at n_prompt+i) is predicted by row n_prompt+i-1.
    return logits[n_prompt - 1: len(ids) - 1].float().log_softmax(-1)


def teacher_forced_kl(model, base, ids: list[int], n_prompt: int) -> dict:
    """Per answer token: KL(P_base || P_model) of the next-token distributions (nats, the convention of
    quantkit.evaluate.agreement), and each model's logprob of the token that was produced."""
    lp_m = _answer_logprobs(model, ids, n_prompt)
    lp_b = _answer_logprobs(base, ids, n_prompt)
    kl = (lp_b.exp() * (lp_b - lp_m)).sum(-1).clamp_min(0.0)  # rounding can leave -1e-7 on equal rows
    answer = torch.tensor(ids[n_prompt:]).unsqueeze(-1)
    return {"kl": kl.tolist(), "model_logprob": lp_m.gather(-1, answer).squeeze(-1).tolist(),
            "base_logprob": lp_b.gather(-1, answer).squeeze(-1).tolist()}


def load_compare(path: str, engine, *, name: str | None = None, dtype=None, prompt_lookup: int | None = None,
                 compile_: bool = False, device: str = "cpu", **engine_kw) -> CompareModel:
    """`--compare BASE`: load the base model next to the served one, checked to share its tokenizer, with its
    own engine. It drafts by prompt lookup when the served model does (no second draft model is loaded), and
    is compiled when the served one is (`--compile`; a float32 base in oneDNN's layout stays eager, its fastest, see
    build.compile_decode), so that their speeds compare like for like."""
    from ..open_model import open_model
    from ..runtime.checkpoint import resolve_path
    from ..runtime.engine import Engine

    # on the served model's device: a base left on the CPU beside a GPU model would not compare speeds like for like
    opened = open_model(path, dtype=dtype, prompt_lookup=prompt_lookup, compile=compile_, warn=lambda note: None,
                        device=device)
    check_same_vocab(engine.model, opened.model, engine.tokenizer, opened.tokenizer)
    base_engine = Engine(opened.model, opened.tokenizer, drafter_factory=opened.make_drafter,
                         num_speculative_tokens=engine.k, **engine_kw)
    return CompareModel(base_engine, name or Path(resolve_path(path)).name)


@dataclass
class PlaygroundState:
    compare: CompareModel | None
    ctx: int  # the shorter context of the two models


def mount(app: FastAPI, *, compare: CompareModel | None = None) -> FastAPI:
    """Add the playground (and, with `compare`, the base model's endpoints and the KL endpoint) to `app`, an
    app made by app.create_app, whose engine and settings it uses."""
    from .app import create_app

    state = app.state.serve
    ctx = state.ctx
    if compare is not None:
        check_same_vocab(state.engine.model, compare.engine.model, state.tokenizer, compare.engine.tokenizer)
        ctx = min(ctx, context_limit(compare.engine.model))
        # the outer app's guards already cover everything mounted in it
        app.mount("/compare", create_app(compare.engine, compare.name, dataclasses.replace(state.config, guard=False)))
    app.state.playground = PlaygroundState(compare, ctx)
    app.add_api_route("/", index, methods=["GET"], include_in_schema=False)
    app.mount("/playground", StaticFiles(directory=STATIC), name="playground")
    app.add_api_route("/v1/playground", playground_config, methods=["GET"])
    app.add_api_route("/v1/playground/kl", playground_kl, methods=["POST"])
    return app


async def index():
    # no-cache: after an upgrade the browser must not pair a stale page with a new server.
    return FileResponse(STATIC / "index.html", media_type="text/html", headers={"Cache-Control": "no-cache"})


async def playground_config(request: Request):
    state, pg = request.app.state.serve, request.app.state.playground
    engine = state.engine
    return {"model": state.model_name, "compare": pg.compare.name if pg.compare else None,
            "chat": getattr(state.tokenizer, "chat_template", None) is not None,
            "speculative": engine.drafter_factory is not None,
            "num_speculative_tokens": engine.k if engine.drafter_factory is not None else 0,
            "max_tokens_limit": min(state.config.max_tokens_limit or pg.ctx, pg.ctx),
            "default_max_tokens": state.config.default_max_tokens}


async def playground_kl(request: Request):
    state, pg = request.app.state.serve, request.app.state.playground
    if pg.compare is None:
        raise APIError("no compare model: start the server with --compare BASE", status=404, code="no_compare_model")
    body = await run_in_threadpool(lambda raw: validate(load_json(raw), KLBody), await request.body())
    ids = await run_in_threadpool(prompt_ids, state.tokenizer, body.prompt, body.messages)
    answer = body.completion_ids
    if not ids:
        raise APIError("the prompt is empty", param="prompt", code="invalid_value")
    if any(not 0 <= t < state.vocab for t in answer):
        raise APIError("completion_ids must be token ids of the vocabulary", param="completion_ids",
                       code="invalid_value")
    if len(ids) + len(answer) > pg.ctx:
        raise APIError(f"prompt and answer have {len(ids) + len(answer)} tokens, more than the context {pg.ctx}",
                       param="completion_ids", code="context_length_exceeded")
    # A forward takes a while: run it off the event loop so streams keep flowing meanwhile.
    out = await run_in_threadpool(teacher_forced_kl, state.engine.model, pg.compare.engine.model, ids + answer,
                                  len(ids))
    return {"model": state.model_name, "base": pg.compare.name, **out}
