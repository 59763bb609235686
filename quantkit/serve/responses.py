"""Answers in OpenAI's shapes: the JSON of a finished request, the SSE chunks of a streamed one, and logprobs
(completions: tokens / token_logprobs / top_logprobs / text_offset; chat: content[] of token, logprob, bytes,
top_logprobs).

Every chunk also carries the non-standard `quantkit_tokens` (OpenAI clients ignore it): each token's id, text,
logprob under the model's own distribution (temperature 1, before any adjustment; the playground shows it)
and whether it was an accepted draft. The OpenAI `logprobs` are those of the distribution each token was
actually drawn from (runtime/processed.py).
"""
from __future__ import annotations

import time

from fastapi.responses import StreamingResponse

from .generation import Job, events_until_end, sse
from .protocol import APIError

# JSON has no -inf, the logprob of a token top-k or top-p cut away; vLLM reports such tokens the same way.
FLOOR = -9999.0


def _lp(x: float) -> float:
    return max(x, FLOOR)


def _usage(job: Job) -> dict:
    n_prompt, n_out = len(job.prompt_ids), job.seq.n_generated
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def _texts(job: Job, ids) -> list[str]:
    tok = job.state.tokenizer
    return [tok.decode([i]) for i in ids]


def completion_logprobs(job: Job, start: int, stop: int, offset: int, with_prompt: bool = False) -> dict:
    """Logprobs of generated tokens [start, stop); text offsets count from `offset`. with_prompt: the echoed
    prompt's tokens first (the first has no logprob: nothing predicts it)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    rows = []
    if with_prompt:
        records = job.seq.prompt_logprobs or [None] * len(job.prompt_ids)
        rows += [(r, text) for r, text in zip(records, _texts(job, job.prompt_ids))]
        offset = 0
    rows += [(r, t.text) for r, t in zip(job.seq.logprobs[start:stop], job.seq.tokens[start:stop])]
    for record, piece in rows:
        out["text_offset"].append(offset)
        offset += len(piece)
        if record is None:
            out["tokens"].append(piece)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        name = _texts(job, [record.id])[0]
        out["tokens"].append(name)
        out["token_logprobs"].append(_lp(record.logprob))
        # The legacy shape: the top alternatives, and the chosen token even when it is not among them.
        top = dict(zip(_texts(job, [i for i, _ in record.top]), (_lp(v) for _, v in record.top)))
        top.setdefault(name, _lp(record.logprob))
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(job: Job, start: int, stop: int) -> dict:
    def entry(token_id, logprob):
        text = _texts(job, [token_id])[0]
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}

    content = [{**entry(r.id, r.logprob), "top_logprobs": [entry(i, v) for i, v in r.top]}
               for r in job.seq.logprobs[start:stop]]
    return {"content": content, "refusal": None}


def _logprobs(job: Job, start: int, stop: int, offset: int = 0, with_prompt: bool = False):
    if job.opts.logprobs is None:
        return None
    if job.opts.chat:
        return chat_logprobs(job, start, stop)
    return completion_logprobs(job, start, stop, offset, with_prompt)


def final(job: Job) -> dict:
    seq, opts = job.seq, job.opts
    text = seq.text()
    echo = opts.echo or ""
    choice = {"index": 0, "finish_reason": seq.finish_reason,
              "logprobs": _logprobs(job, 0, len(seq.tokens), len(echo), opts.echo is not None)}
    choice.update({"message": {"role": "assistant", "content": text}} if opts.chat else {"text": echo + text})
    return {"id": job.id, "object": "chat.completion" if opts.chat else "text_completion", "created": int(time.time()),
            "model": job.state.model_name, "choices": [choice], "usage": _usage(job),
            "quantkit": {"details": f"/v1/details/{job.req.id}", "metrics": seq.metrics.to_dict()}}


def _chunk(job: Job, choice: dict, toks=None) -> str:
    opts = job.opts
    out = {"id": job.id, "object": "chat.completion.chunk" if opts.chat else "text_completion",
           "created": int(time.time()), "model": job.state.model_name, "choices": [choice]}
    if opts.include_usage:
        out["usage"] = None
    if toks:
        out["quantkit_tokens"] = [{"id": t.id, "text": t.text, "logprob": t.logprob, "drafted": t.drafted}
                                  for t in toks]
        # Running totals, so a client (the playground) can show the acceptance rate while it streams; read
        # while the worker may be a step ahead, so exact figures come from /v1/details/{id}.
        m = job.seq.metrics
        out["quantkit_metrics"] = {"drafted": m.drafted, "accepted": m.accepted, "spec_steps": m.spec_steps}
    return sse(out)


def _text_choice(job: Job, text: str, finish, logprobs=None, first: bool = False) -> dict:
    if job.opts.chat:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if finish is None else {})
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}


async def _chunks(job: Job):
    opts, sent, offset = job.opts, 0, len(job.opts.echo or "")
    echo = opts.echo
    if opts.chat:
        yield _chunk(job, _text_choice(job, "", None, first=True))
    async for kind, payload in events_until_end(job):
        if echo is not None and kind != "error":
            # after the first event: by then the prefill has recorded the prompt's logprobs
            yield _chunk(job, _text_choice(job, echo, None, _logprobs(job, 0, 0, 0, True)))
            echo = None
        if kind == "error":
            yield sse(APIError(f"{payload} (request {job.req.id})", status=500, type="server_error").body())
            break
        if kind == "done":
            yield _chunk(job, _text_choice(job, "", job.seq.finish_reason))
            if opts.include_usage:
                yield sse({"id": job.id, "object": "chat.completion.chunk" if opts.chat else "text_completion",
                           "created": int(time.time()), "model": job.state.model_name, "choices": [],
                           "usage": _usage(job)})
            break
        text = "".join(t.text for t in payload)
        yield _chunk(job, _text_choice(job, text, None, _logprobs(job, sent, sent + len(payload), offset)), payload)
        sent, offset = sent + len(payload), offset + len(text)
    yield "data: [DONE]\n\n"


def stream(job: Job) -> StreamingResponse:
    return StreamingResponse(_chunks(job), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Request-Id": job.req.id})
