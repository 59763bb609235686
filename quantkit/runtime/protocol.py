"""OpenAI request bodies (validated strictly, so wrong types are refused rather than coerced) and errors."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    # Unknown fields (user, logit_bias, ...) are tolerated, as clients send them; types are checked strictly.
    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # not in OpenAI's API; vLLM accepts it too
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionBody(_Body):
    prompt: str | list[str] | list[int]


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None


class APIError(Exception):
    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}
