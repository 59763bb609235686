"""GET /v1/models, /v1/details/{id}, /health and /metrics: what is served, and how it is going."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from .config import ServeState
from .protocol import APIError

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request):
    state: ServeState = request.app.state.serve
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                        "owned_by": "quantkit", "max_model_len": state.ctx}]}


@router.get("/v1/details/{rid}")
async def details(request: Request, rid: str):
    engine = request.app.state.serve.engine
    d = engine.details.get(rid)
    if d is None:
        raise APIError(f"no finished request '{rid[:100]}' (details are kept for the last {engine.keep_details})",
                       status=404, param="id", code="not_found")
    return d


@router.get("/health")
async def health(request: Request):
    return {"status": "ok", "model": request.app.state.serve.model_name}


@router.get("/metrics")
async def metrics(request: Request):
    text = request.app.state.serve.engine.metrics.render() + request.app.state.responses.render()
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")
