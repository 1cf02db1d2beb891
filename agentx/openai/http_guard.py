"""What stands between a browser and a loopback server: Host, Origin and content type.

With no API key (the default) a server on 127.0.0.1 is reachable from any web page the user
opens: a cross-origin ``text/plain`` POST needs no CORS preflight (CSRF), and a DNS name that
rebinds to 127.0.0.1 makes the page same-origin (DNS rebinding). This ASGI middleware refuses,
with OpenAI-shaped errors:

    Host not in the allowed hosts              400 invalid_host
    Origin not in --allowed-origins            403 origin_not_allowed (preflight included)
    a POST body that is not application/json   415 unsupported_media_type

Allowed hosts: 127.0.0.1, localhost, ::1, the bound address and ``allowed_hosts`` ("*": any;
a wildcard bind address accepts any Host unless ``allowed_hosts`` is given). An allowed
Origin gets CORS headers, and its ``OPTIONS`` preflight answers 204. A request without an
Origin (curl, SDKs) is not a browser's cross-origin request and passes. It knows ASGI only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

__all__ = ["HTTPGuard"]

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_WILDCARD_BINDS = ("0.0.0.0", "::", "")
_ALLOW_METHODS = "GET, POST, OPTIONS"
_ALLOW_HEADERS = "authorization, content-type"


class HTTPGuard:
    def __init__(
        self,
        app,
        *,
        host: str = "127.0.0.1",
        allowed_hosts: Iterable[str] = (),
        allowed_origins: Iterable[str] = (),
    ) -> None:
        self.app = app
        hosts = [h.lower() for h in allowed_hosts]
        self.any_host = "*" in hosts or (host in _WILDCARD_BINDS and not hosts)
        self.hosts = frozenset([*_LOOPBACK, host.lower(), *hosts])
        self.origins = frozenset(o.rstrip("/") for o in allowed_origins)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = _hostname(headers.get("host", ""))
        if not self.any_host and host not in self.hosts:
            return await _refuse(send, 400, f"host {host!r} is not allowed", "invalid_host")
        origin = headers.get("origin")
        cors = []
        if origin is not None:
            if not self._origin_allowed(origin, headers.get("host", "")):
                message = f"origin {origin!r} is not allowed (see --allowed-origins)"
                return await _refuse(send, 403, message, "origin_not_allowed")
            cors = [(b"access-control-allow-origin", origin.encode()), (b"vary", b"Origin")]
            if scope["method"] == "OPTIONS":
                return await _preflight(send, cors, headers)
        if scope["method"] == "POST" and not _is_json(headers.get("content-type", "")):
            message = "the request body must be sent as 'content-type: application/json'"
            return await _refuse(send, 415, message, "unsupported_media_type", cors)
        if not cors:
            return await self.app(scope, receive, send)

        async def send_with_cors(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        return await self.app(scope, receive, send_with_cors)

    def _origin_allowed(self, origin: str, host_header: str) -> bool:
        origin = origin.rstrip("/")
        if "*" in self.origins or origin in self.origins:
            return True
        return origin in (f"http://{host_header}", f"https://{host_header}")  # same origin


def _hostname(host_header: str) -> str:
    host = host_header.strip().lower()
    if host.startswith("["):  # [::1]:8000
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and "+json" in media)


async def _preflight(send, cors: list, headers: dict[str, str]) -> None:
    allow = headers.get("access-control-request-headers", _ALLOW_HEADERS)
    extra = [
        (b"access-control-allow-methods", _ALLOW_METHODS.encode()),
        (b"access-control-allow-headers", allow.encode()),
        (b"access-control-max-age", b"600"),
    ]
    await send({"type": "http.response.start", "status": 204, "headers": cors + extra})
    await send({"type": "http.response.body", "body": b""})


async def _refuse(send, status: int, message: str, code: str, headers: list = ()) -> None:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    body = json.dumps({"error": error}).encode()
    start_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": start_headers})
    await send({"type": "http.response.body", "body": body})
