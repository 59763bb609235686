"""POST /v1/chat/completions: messages in (through the model's chat template), the assistant's answer out."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from . import responses
from .config import ServeState
from .generation import Options, check_model, check_prompt, read_body, sampling_params, start, until_done
from .protocol import APIError, ChatBody, Message

router = APIRouter()


def template_ids(tok, messages: list[Message]) -> list[int]:
    """Token ids of the messages under the chat template (a 400 when the template refuses them)."""
    if getattr(tok, "chat_template", None) is None:
        raise APIError("this model has no chat template; use /v1/completions", code="no_chat_template")
    msgs = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name is not None else {})}
            for m in messages]
    try:
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    except Exception as e:  # a template may raise on what it does not accept (roles out of order, ...)
        raise APIError(f"the model's chat template refused these messages: {str(e)[:300]}", param="messages",
                       code="invalid_value") from None
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state: ServeState = request.app.state.serve
    body, received = await read_body(request, ChatBody)
    check_model(state, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    ids = await run_in_threadpool(template_ids, state.tokenizer, body.messages)
    check_prompt(state, ids)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(state, body, max_tokens, state.config.default_max_tokens, len(ids), logprobs)
    opts = Options(chat=True, stream=bool(body.stream), include_usage=body.include_usage, logprobs=logprobs)
    job = start(state, ids, params, opts, received)
    if opts.stream:
        return responses.stream(job)
    await until_done(request, job)
    return JSONResponse(responses.final(job), headers={"X-Request-Id": job.req.id})  # as streams carry it
