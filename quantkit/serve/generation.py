"""One request on the engine: its sampling parameters, its submission, then either waiting for its end (a JSON
answer) or streaming its tokens as they come (SSE). A client that goes away cancels its request in both cases,
so an abandoned request stops holding a decode slot at the engine's next step."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from ..errors import UserError
from ..runtime.engine import QueueFull, Request
from ..runtime.sequence import Sequence
from ..runtime.sampling import SamplingParams
from .config import ServeState
from .protocol import APIError, parse


@dataclass
class Options:
    """What the answer's shape needs beyond the sampled tokens."""

    chat: bool
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # alternatives per token (None: no logprobs)
    echo: str | None = None  # the prompt text, prepended to a completion's answer


@dataclass
class Job:
    state: ServeState
    req: Request
    seq: Sequence
    events: asyncio.Queue
    prompt_ids: list[int]
    opts: Options

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.opts.chat else "cmpl-") + self.req.id


def sampling_params(state: ServeState, body, max_tokens: int | None, default: int, n_prompt: int,
                    logprobs: int | None) -> SamplingParams:
    """max_tokens: as asked (None: `default`, cut to the context left)."""
    if max_tokens is not None and not 1 <= max_tokens <= state.max_limit:
        raise APIError(f"max_tokens must be between 1 and {state.max_limit}, got {max_tokens}", param="max_tokens",
                       code="invalid_value")
    room = state.ctx - n_prompt
    if max_tokens is None or state.config.clamp_max_tokens:
        max_tokens = min(max_tokens or default, state.max_limit, room)
    elif max_tokens > room:  # as vLLM answers: a cut answer would look like a finished one
        raise APIError(f"This model's maximum context length is {state.ctx} tokens. However, you requested "
                       f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the completion)."
                       " Please reduce the length of the prompt or max_tokens.", param="max_tokens",
                       code="context_length_exceeded")
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit() and int(key) < state.vocab):
            raise APIError(f"logit_bias keys must be token ids below {state.vocab}, got '{key[:40]}'",
                           param="logit_bias", code="invalid_value")
        bias[int(key)] = value
    params = SamplingParams(
        max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, seed=body.seed,
        stop=body.stop_list, logit_bias=bias, presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0, logprobs=logprobs, ignore_eos=bool(body.ignore_eos))
    try:
        return params.validate()
    except UserError as e:
        raise APIError(str(e), code="invalid_value") from None


def check_prompt(state: ServeState, ids: list[int]) -> None:
    if not ids:
        raise APIError("the prompt is empty", param="prompt", code="invalid_value")
    if len(ids) >= state.ctx:
        raise APIError(f"the prompt has {len(ids)} tokens but the model's context is {state.ctx}; shorten it",
                       param="prompt", code="context_length_exceeded")
    if any(not 0 <= t < state.vocab for t in ids):
        raise APIError(f"prompt token ids must be below {state.vocab}, the vocabulary's size", param="prompt",
                       code="invalid_value")


async def read_body(request, cls):
    """(the parsed body, when reading it began: the start of the request's time split, metrics.split_s)"""
    received = time.perf_counter()
    return await run_in_threadpool(parse, await request.body(), cls), received


def check_model(state: ServeState, body) -> None:
    if body.model != state.model_name:
        raise APIError(f"unknown model '{body.model[:100]}'; this server serves '{state.model_name}' (see /v1/models)",
                       param="model", code="model_not_found")


def start(state: ServeState, ids: list[int], params: SamplingParams, opts: Options, received: float) -> Job:
    """received: time.perf_counter() when the handler began, the start of the request's time split."""
    prompt_logprobs = opts.echo is not None and opts.logprobs is not None
    try:
        seq = state.engine.new_sequence(ids, params, prompt_logprobs=prompt_logprobs)
    except UserError as e:
        raise APIError(str(e)) from None
    seq.metrics.t_received = received
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def on_event(kind, payload):  # called on the engine's worker thread
        loop.call_soon_threadsafe(events.put_nowait, (kind, payload))

    try:
        req = state.engine.submit(seq, on_event)
    except QueueFull as e:
        raise APIError(str(e), status=429, type="rate_limit_error", code="queue_full") from None
    return Job(state, req, seq, events, ids, opts)


async def _client_gone(request) -> None:
    # The body is read; what the server passes on next is the client's disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_done(request, job: Job) -> None:
    """Wait for a non-streaming request to end; if the client goes away first, cancel it (499)."""
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        while True:
            event = asyncio.ensure_future(job.events.get())
            await asyncio.wait({event, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not event.done():
                event.cancel()
                job.req.cancelled = True
                raise APIError("the client closed the connection", status=499, code="client_closed_request")
            kind, payload = event.result()
            if kind == "error":
                raise APIError(f"{payload} (request {job.req.id})", status=500, type="server_error")
            if kind == "done":
                return
    finally:
        gone.cancel()


async def events_until_end(job: Job):
    """(kind, payload) as they come, ending after "done" or "error"; cancels the request if the stream is
    left unfinished (the client went away and the response's task was cancelled)."""
    try:
        while True:
            kind, payload = await job.events.get()
            yield kind, payload
            if kind in ("done", "error"):
                return
    finally:
        if not job.seq.done:
            job.req.cancelled = True


def sse(data) -> str:
    return f"data: {json.dumps(data)}\n\n"
