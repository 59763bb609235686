"""OpenAI-compatible HTTP server over the Engine: completions, chat completions (SSE streaming), models,
health, Prometheus metrics, and per-token details (text, logprob, whether a drafted token was accepted).

Every streamed chunk carries the non-standard field `quantkit_tokens` (OpenAI clients ignore it), and a
finished request's details stay available at GET /v1/details/{id} for a while.
"""
from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError

from ..errors import UserError
from .engine import Engine, QueueFull
from .generate import context_limit
from .protocol import APIError, ChatBody, CompletionBody
from .sampling import SamplingParams


def _content_text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def create_app(engine: Engine, model_name: str, *, max_tokens_limit: int | None = None,
               default_max_tokens: int = 256) -> FastAPI:
    app = FastAPI(title="quantkit", docs_url=None, redoc_url=None)
    tok = engine.tokenizer
    ctx = context_limit(engine.model)
    max_limit = min(max_tokens_limit or ctx, ctx)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(404)
    async def _not_found(request, _):
        return JSONResponse(APIError(f"no route {request.url.path}", status=404, code="not_found").body(), 404)

    @app.exception_handler(405)
    async def _bad_method(request, _):
        return JSONResponse(APIError(f"method {request.method} not allowed on {request.url.path}", status=405,
                                     code="method_not_allowed").body(), 405)

    async def parse(request: Request, cls):
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError("the request body must be a JSON object", code="invalid_json")
        try:
            body = cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(x) for x in err["loc"]) or None
            code = "missing_required_parameter" if err["type"] == "missing" else "invalid_type"
            raise APIError(f"{param}: {err['msg']}", param=param, code=code) from None
        if body.model != model_name:
            raise APIError(f"unknown model '{body.model}'; this server serves '{model_name}' (see /v1/models)",
                           param="model", code="model_not_found")
        if body.n != 1:
            raise APIError("only n=1 is supported", param="n", code="unsupported_value")
        return body

    def sampling_params(body, max_tokens) -> SamplingParams:
        if max_tokens is None:
            max_tokens = default_max_tokens
        if not 1 <= max_tokens <= max_limit:
            raise APIError(f"max_tokens must be between 1 and {max_limit}, got {max_tokens}", param="max_tokens",
                           code="invalid_value")
        params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                top_k=body.top_k, seed=body.seed, stop=body.stop_list)
        try:
            return params.validate()
        except UserError as e:
            raise APIError(str(e), code="invalid_value") from None

    def check_prompt(ids: list[int]) -> None:
        if not ids:
            raise APIError("the prompt is empty", param="prompt", code="invalid_value")
        if len(ids) >= ctx:
            raise APIError(f"the prompt has {len(ids)} tokens but the model's context is {ctx}; shorten it",
                           param="prompt", code="context_length_exceeded")

    async def run(prompt_ids, params, body, chat: bool):
        check_prompt(prompt_ids)
        try:
            seq = engine.new_sequence(prompt_ids, params)
        except UserError as e:
            raise APIError(str(e)) from None
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_event(kind, payload):
            loop.call_soon_threadsafe(events.put_nowait, (kind, payload))

        try:
            req = engine.submit(seq, on_event)
        except QueueFull as e:
            raise APIError(str(e), status=429, type="rate_limit_error", code="queue_full") from None
        rid = ("chatcmpl-" if chat else "cmpl-") + req.id
        obj = "chat.completion" if chat else "text_completion"

        def usage():
            n_out = seq.n_generated
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": n_out,
                    "total_tokens": len(prompt_ids) + n_out}

        if not body.stream:
            while True:
                kind, payload = await events.get()
                if kind == "error":
                    raise APIError(payload, status=500, type="server_error")
                if kind == "done":
                    break
            text = seq.text()
            choice = {"index": 0, "finish_reason": seq.finish_reason, "logprobs": None}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                                 "choices": [choice], "usage": usage(),
                                 "quantkit": {"details": f"/v1/details/{req.id}",
                                              "metrics": seq.metrics.to_dict()}})

        def chunk(delta_text, finish, toks=None, first=False):
            if chat:
                delta = {"role": "assistant", "content": delta_text} if first else \
                    ({"content": delta_text} if finish is None else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_text, "logprobs": None, "finish_reason": finish}
            out = {"id": rid, "object": obj + (".chunk" if chat else ""), "created": int(time.time()),
                   "model": model_name, "choices": [choice]}
            if body.include_usage:
                out["usage"] = None
            if toks:
                out["quantkit_tokens"] = [{"id": t.id, "text": t.text, "logprob": t.logprob, "drafted": t.drafted}
                                          for t in toks]
                # Running totals, so a client (the playground) can show the acceptance rate while it streams;
                # read while the worker may be a step ahead, so exact figures come from /v1/details/{id}.
                m = seq.metrics
                out["quantkit_metrics"] = {"drafted": m.drafted, "accepted": m.accepted, "spec_steps": m.spec_steps}
            return f"data: {json.dumps(out)}\n\n"

        async def sse():
            try:
                if chat:
                    yield chunk("", None, first=True)
                while True:
                    kind, payload = await events.get()
                    if kind == "error":
                        err = APIError(payload, status=500, type="server_error").body()
                        yield f"data: {json.dumps(err)}\n\n"
                        break
                    if kind == "done":
                        yield chunk("", seq.finish_reason)
                        if body.include_usage:
                            last = {"id": rid, "object": obj + (".chunk" if chat else ""),
                                    "created": int(time.time()), "model": model_name, "choices": [],
                                    "usage": usage()}
                            yield f"data: {json.dumps(last)}\n\n"
                        break
                    yield chunk("".join(t.text for t in payload), None, payload)
                yield "data: [DONE]\n\n"
            finally:
                if not seq.done:  # the client went away: stop spending decode steps on it
                    req.cancelled = True

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": req.id})

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, CompletionBody)
        params = sampling_params(body, body.max_tokens if body.max_tokens is not None else 16)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError("one prompt per request is supported", param="prompt", code="unsupported_value")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = tok(prompt)["input_ids"]
        else:
            if any(not 0 <= t < len(tok) for t in prompt):
                raise APIError("prompt token ids must be in the vocabulary", param="prompt", code="invalid_value")
            ids = list(prompt)
        return await run(ids, params, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse(request, ChatBody)
        mt = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = sampling_params(body, mt)
        msgs = [{"role": m.role, "content": _content_text(m.content)} for m in body.messages]
        if getattr(tok, "chat_template", None) is None:
            raise APIError("this model has no chat template; use /v1/completions", code="no_chat_template")
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return await run(list(ids), params, body, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "quantkit", "max_model_len": ctx}]}

    @app.get("/v1/details/{rid}")
    async def details(rid: str):
        d = engine.details.get(rid)
        if d is None:
            raise APIError(f"no finished request '{rid}' (details are kept for the last {engine.keep_details})",
                           status=404, param="id", code="not_found")
        return d

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    return app
