"""Checks every request passes before a handler sees it (pure ASGI, so they also cover mounted apps):

- the Host header names this server (DNS rebinding: a web page whose name resolves to 127.0.0.1 must not read
  the answers of a server bound there);
- the API key, on every route but the playground page and its files, /health and /metrics, compared in
  constant time;
- a body is JSON: a cross-origin "simple" request (text/plain, a form, no type at all) needs no CORS
  preflight, so without this any web page could make the server spend CPU; JSON needs a preflight, which
  fails unless --allowed-origins lets that origin in;
- the body is at most --max-body-bytes (413), counted as it arrives, not only from Content-Length.
"""
from __future__ import annotations

import hmac
import ipaddress

from starlette.responses import JSONResponse

from .protocol import APIError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
OPEN_PATHS = frozenset({"/", "/health", "/metrics"})
OPEN_PREFIXES = ("/playground/",)
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::", "[::]")


def allowed_host_names(bind_host: str, extra: tuple[str, ...] = ()) -> frozenset[str] | None:
    """Host names requests may carry; None when any is accepted (bound to every address, no --allowed-hosts,
    or '*' among them)."""
    names = {h.strip().lower().strip("[]").rstrip(".") for h in extra}
    if "*" in names:
        return None
    if is_wildcard(bind_host):
        return frozenset(names) if names else None
    names.add(bind_host.lower().strip("[]"))
    if is_loopback(bind_host):
        names |= LOOPBACK_NAMES
    return frozenset(names)


def host_name(header: str) -> str:
    """'[::1]:8000' -> '::1', 'Example.com.:80' -> 'example.com'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0].rstrip(".") if header.count(":") == 1 else header.rstrip(".")


def _headers(scope) -> dict[bytes, bytes]:
    return {k.lower(): v for k, v in scope.get("headers", [])}


def _key_ok(headers: dict[bytes, bytes], key: bytes) -> bool:
    scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
    # compare_digest: how long a wrong key takes to refuse must not tell how much of it was right
    return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), key)


async def _refuse(scope, receive, send, err: APIError) -> None:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    await JSONResponse(err.body(), status_code=err.status, headers=headers)(scope, receive, send)


class HostCheck:
    def __init__(self, app, allowed: frozenset[str] | None):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.allowed is not None:
            raw = _headers(scope).get(b"host")
            name = host_name(raw.decode("latin-1")) if raw is not None else None
            if name is not None and name not in self.allowed:
                err = APIError(f"Host '{name[:100]}' is not a name of this server; start it with --allowed-hosts "
                               "to accept more", param="host", code="host_not_allowed")
                return await _refuse(scope, receive, send, err)
        await self.app(scope, receive, send)


class RequestGuard:
    """API key, JSON content type and body size, in that order."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int):
        self.app, self.max_body = app, max_body_bytes
        self.key = api_key.encode("utf-8") if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        path = scope.get("path", "")
        if self.key is not None and path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES) \
                and not _key_ok(headers, self.key):
            err = APIError("a valid API key is needed: send the header 'Authorization: Bearer KEY'", status=401,
                           code="invalid_api_key")
            return await _refuse(scope, receive, send, err)
        if scope.get("method") not in BODY_METHODS:
            return await self.app(scope, receive, send)
        kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if kind != b"application/json":
            err = APIError(f"the body must be JSON: send 'Content-Type: application/json' (got "
                           f"'{kind.decode('latin-1')[:100] or 'none'}')", status=415, code="unsupported_media_type")
            return await _refuse(scope, receive, send, err)
        body = await self._read(headers, receive)
        if isinstance(body, APIError):
            return await _refuse(scope, receive, send, body)
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, headers, receive) -> bytes | APIError:
        too_big = APIError(f"the request body is larger than this server's limit of {self.max_body} bytes "
                           "(--max-body-bytes)", status=413, code="request_too_large")
        length = headers.get(b"content-length")
        if length is not None and (not length.strip().isdigit() or int(length) > self.max_body):
            return too_big if length.strip().isdigit() else APIError("bad Content-Length header")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return APIError("the client went away", status=499)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:  # a chunked body has no Content-Length to check beforehand
                return too_big
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: what the server says next (the client's disconnect)

    return replay
