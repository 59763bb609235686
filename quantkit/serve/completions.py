"""POST /v1/completions: text (or token ids) in, its continuation out; `echo` and `logprobs` as OpenAI's."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from . import responses
from .config import ServeState
from .generation import Options, check_model, check_prompt, read_body, sampling_params, start, until_done
from .protocol import APIError, CompletionBody

router = APIRouter()

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


async def prompt_ids(state: ServeState, prompt, echo: bool) -> tuple[list[int], str | None]:
    """The prompt's token ids, and its text when it is to be echoed."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError("one prompt per request is supported", param="prompt", code="unsupported_value")
        prompt = prompt[0]
    tok = state.tokenizer
    if isinstance(prompt, str):
        # off the event loop: a long prompt takes seconds to tokenise, and /health must answer meanwhile
        return list(await run_in_threadpool(lambda: tok(prompt)["input_ids"])), prompt if echo else None
    check_prompt(state, prompt)
    return list(prompt), (await run_in_threadpool(tok.decode, prompt)) if echo else None


@router.post("/v1/completions")
async def completions(request: Request):
    state: ServeState = request.app.state.serve
    body, received = await read_body(request, CompletionBody)
    check_model(state, body)
    ids, text = await prompt_ids(state, body.prompt, bool(body.echo))
    check_prompt(state, ids)
    params = sampling_params(state, body, body.max_tokens, DEFAULT_MAX_TOKENS, len(ids), body.logprobs)
    opts = Options(chat=False, stream=bool(body.stream), include_usage=body.include_usage, logprobs=body.logprobs,
                   echo=text)
    job = start(state, ids, params, opts, received)
    if opts.stream:
        return responses.stream(job)
    await until_done(request, job)
    return JSONResponse(responses.final(job), headers={"X-Request-Id": job.req.id})  # as streams carry it
