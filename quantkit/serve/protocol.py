"""OpenAI request bodies and errors.

Bodies are parsed and validated before anything reaches the tokenizer or the engine, so that no input can end
in a 500: JSON without NaN or infinities, valid Unicode (no lone surrogates), bounded numbers, strict types.
Unknown parameters are refused (as OpenAI's API does) rather than ignored, and so are known ones this server
cannot honour: a parameter that would change what the answer means must never be dropped silently.
"""
from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

INT64 = 2 ** 63
MAX_LOGPROBS = 20  # as vLLM's default max_logprobs
MAX_STOP = 16
MAX_STOP_CHARS = 1000  # each stop string is matched against the text's tail at every token

Finite = Annotated[float, Field(allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class APIError(Exception):
    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


class StrictModel(BaseModel):
    # strict: a string is not a number; forbid: a misspelt or unknown parameter is refused, never ignored
    model_config = ConfigDict(strict=True, extra="forbid")


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class Message(StrictModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(StrictModel):
    include_usage: bool | None = None


# name -> the values that ask for nothing beyond what this server does; anything else is refused by name
_NO_OP = {
    "best_of": (None, 1), "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "functions": (None, []), "function_call": (None, "none", "auto"), "response_format": (None, {"type": "text"}),
    "audio": (None,), "modalities": (None, ["text"]),
}
_WHY = {"response_format": "this server cannot constrain its output to JSON",
        "best_of": "this server returns one sampled answer", "suffix": "this server has no insertion mode"}


class _Body(StrictModel):
    model: str
    max_tokens: int | None = None
    temperature: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None  # not in OpenAI's API; vLLM accepts it too
    seed: Annotated[int, Field(ge=-INT64, lt=INT64)] | None = None  # what torch's generator takes
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    ignore_eos: bool | None = None  # not in OpenAI's API; vLLM's: generate max_tokens tokens whatever comes
    # Accepted and ignored: none of them changes the answer.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    # Refused unless they ask for nothing (_NO_OP).
    best_of: Any = None
    suffix: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def refuse_unsupported(self) -> None:
        for name, no_op in _NO_OP.items():
            value = getattr(self, name)
            if not any(value == ok and type(value) is type(ok) for ok in no_op):
                why = _WHY.get(name, "this server has no support for it")
                raise APIError(f"'{name}' is not supported: {why}; leave it out", param=name,
                               code="unsupported_parameter")
        if self.n not in (None, 1):
            raise APIError("only n=1 is supported", param="n", code="unsupported_value")


class CompletionBody(_Body):
    prompt: str | list[str] | list[Annotated[int, Field(ge=0, lt=INT64)]]
    echo: bool | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses to inf, which no parameter can use
        raise ValueError(f"the number {text[:32]} is out of range")
    return value


def load_json(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    try:
        data = json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise APIError("the request body is nested too deeply", code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise APIError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except ValueError as e:  # also UnicodeDecodeError, and integers past Python's 4300-digit limit
        raise APIError(f"the request body is not valid JSON: {str(e).split(';')[0]}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object", code="invalid_json")
    for key, value in data.items():
        try:
            # JSON's \ud800 escapes decode to lone surrogates, which no tokenizer (nor UTF-8) can take.
            json.dumps([key, value], ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(f"'{ascii(key)[1:-1]}' holds a lone UTF-16 surrogate; send valid Unicode text",
                           param=ascii(key)[1:-1], code="invalid_value") from None
        except RecursionError:
            raise APIError("the request body is nested too deeply", code="invalid_json") from None
    return data


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _param(loc) -> str | None:
    # pydantic puts the union member it tried into the location ("list[int]", "str", "constrained-str"): not a
    # parameter name, so never shown to a client
    parts = [str(x) for x in loc if not (isinstance(x, str) and ("[" in x or "-" in x or x in _TYPE_TAGS))]
    return ".".join(parts) or None


def _most_specific(errors: list[dict]) -> dict:
    """Of a union's errors, one from the member the value's type matched (a list of 100 stop strings is too long,
    not 'not a string'): the first error that is not a type mismatch, where the first error's field has one."""
    field = errors[0]["loc"][:1]
    same = [e for e in errors if e["loc"][:1] == field]
    return next((e for e in same if not e["type"].endswith("_type")), errors[0])


def validate(data: dict, cls):
    try:
        return cls.model_validate(data)
    except RecursionError:
        raise APIError("the request body is nested too deeply", code="invalid_json") from None
    except ValidationError as e:
        err = _most_specific(e.errors(include_url=False))
        param = _param(err["loc"])
        if err["type"] == "extra_forbidden":
            raise APIError(f"Unrecognized request argument supplied: {param}", param=param,
                           code="unknown_parameter") from None
        code = "missing_required_parameter" if err["type"] == "missing" else "invalid_type"
        if err["type"].endswith(("than", "equal", "_length", "too_long", "too_short", "finite_number")):
            code = "invalid_value"
        raise APIError(f"{param}: {err['msg']}", param=param, code=code) from None


def parse(raw: bytes, cls):
    """Parse and validate a body (run it off the event loop: a large body takes a while)."""
    body = validate(load_json(raw), cls)
    body.refuse_unsupported()
    return body
