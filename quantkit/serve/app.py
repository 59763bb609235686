"""The FastAPI app: the handlers' routers (completions.py, chat.py, info.py), the shared state they read from
`request.app.state.serve`, OpenAI-style error bodies for every error, and the guards around it all
(security.py: Host, API key, JSON bodies and their size; CORS only for --allowed-origins; metrics.py counts
every response, refusals included)."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from . import chat, completions, info
from .config import ServeConfig, ServeState
from .metrics import ResponseCounts, StatusCounter
from .protocol import APIError
from .security import HostCheck, RequestGuard, allowed_host_names

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


async def _api_error(request: Request, e: APIError):
    return JSONResponse(e.body(), status_code=e.status)


async def _http_error(request: Request, e: HTTPException):
    if e.status_code == 404:
        message = f"no route {request.url.path[:200]}"
    elif e.status_code == 405:
        message = f"method {request.method} not allowed on {request.url.path[:200]}"
    else:
        message = str(e.detail)
    err = APIError(message, status=e.status_code, code=_HTTP_CODES.get(e.status_code))
    return JSONResponse(err.body(), status_code=e.status_code, headers=e.headers)


async def _server_error(request: Request, e: Exception):
    # A bug, never bad input (that is a 4xx): the traceback still goes to the log, the client gets the OpenAI shape.
    err = APIError(f"internal error: {type(e).__name__}", status=500, type="server_error")
    return JSONResponse(err.body(), status_code=500)


def create_app(engine, model_name: str, config: ServeConfig | None = None, **settings) -> FastAPI:
    """The server over `engine`, answering as `model_name`; settings: ServeConfig's fields, when no config."""
    config = config or ServeConfig(**settings)
    app = FastAPI(title="quantkit", docs_url=None, redoc_url=None)
    app.state.serve = ServeState(engine, model_name, config)
    app.state.responses = ResponseCounts()
    for module in (completions, chat, info):
        app.include_router(module.router)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _server_error)
    if config.guard:
        # add_middleware wraps what is there: the last added runs first
        app.add_middleware(RequestGuard, api_key=config.api_key, max_body_bytes=config.max_body_bytes)
        if config.allowed_origins:
            app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                               allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"])
        app.add_middleware(HostCheck, allowed=allowed_host_names(config.host, config.allowed_hosts))
        app.add_middleware(StatusCounter, counts=app.state.responses)
    return app
