"""What one app serves and how: its settings, and the state its handlers read from `request.app.state.serve`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..runtime.sequence import context_limit
from ..drafts.model_draft import vocab_rows

DEFAULT_MAX_BODY_BYTES = 2 << 20  # a full 128k-token context as text or as a list of ids fits


@dataclass(frozen=True)
class ServeConfig:
    max_tokens_limit: int | None = None  # the largest max_tokens a request may ask (None: the context)
    default_max_tokens: int = 256  # chat requests that give none (completions default to 16, as OpenAI's)
    clamp_max_tokens: bool = False  # cut max_tokens to the context left instead of answering 400
    api_key: str | None = None
    host: str = "127.0.0.1"  # the address bound: Host headers are checked against it (security.py)
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    header_timeout: float = 10.0  # seconds a connection has for a request's headers (http_limits.py)
    max_connections: int = 512  # open connections and requests in flight beyond which requests get 503
    guard: bool = True  # off for an app mounted inside another one, whose guard already ran


@dataclass
class ServeState:
    engine: object  # runtime.engine.Engine
    model_name: str
    config: ServeConfig
    ctx: int = 0
    vocab: int = 0
    max_limit: int = 0
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        model = self.engine.model
        self.ctx = context_limit(model)
        # token ids a prompt may hold: both the tokenizer and the model's embedding must know them
        self.vocab = min(len(self.engine.tokenizer), vocab_rows(model))
        self.max_limit = min(self.config.max_tokens_limit or self.ctx, self.ctx)

    @property
    def tokenizer(self):
        return self.engine.tokenizer
