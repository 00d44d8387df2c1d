"""Authentication before anything else: an ASGI middleware in front of the app's routes.

FastAPI reads and parses a request's JSON body before a route's dependencies run, so a key
checked by a dependency came after the body: a 200 MiB POST without a key grew the server by
560 MiB before its 401 (security review, issue 43). Here every request under ``/v1/`` and to
``/metrics`` is authenticated from its headers first; a missing or bad key is answered 401
without reading a byte of the body (uvicorn stops reading the socket and closes the
connection). A request with a good key to any route but an object upload has its body capped
at ``json_max_bytes``: a declared ``Content-Length`` above it is answered 413 at once, and a
body sent without one is read only up to the cap.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.routing import Match

from ciuic.catalog import Catalog
from ciuic.catalog.keys import KeyInfo, authenticate

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

#: the largest body of a request that is not an object upload (a batch ``missing`` call of
#: 100 000 chunk keys is 8 MB; a run report of 10 000 events a few MB)
DEFAULT_JSON_MAX_BYTES = 16 * 1024 * 1024


def key_of(headers: dict[str, str]) -> str:
    """The API key a request carries: ``Authorization: Bearer KEY`` or ``X-API-Key: KEY``."""
    header = headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return headers.get("x-api-key", "").strip()


def needs_key(path: str) -> bool:
    """The API and the metrics; not the dashboard's page, ``/health`` or the schema."""
    return path.startswith("/v1/") or path == "/metrics"


def is_upload(method: str, path: str) -> bool:
    """An object upload: capped by the object limit in its route, not here."""
    return method == "PUT" and "/objects/" in path


class Guard:
    """The ASGI middleware (see the module docstring). The key's :class:`KeyInfo` goes in
    ``request.state.key`` for the routes; its id in ``request.state.key_id`` for the logs."""

    def __init__(self, app: App, catalog: Catalog, json_max_bytes: int, routes: Any) -> None:
        self.app, self.catalog, self.json_max_bytes = app, catalog, json_max_bytes
        self.routes = routes  # the app's routes: a refusal is counted under its route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not needs_key(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope["headers"]}
        key = key_of(headers)
        if not key:
            await self._refuse(scope, send, 401, "missing_key", "send an API key: "
                               "'Authorization: Bearer <key>' (`ciuic apikey create --project "
                               "P --role R` makes one)")
            return
        info: KeyInfo | None = await run_in_threadpool(authenticate, self.catalog, key)
        if info is None:
            await self._refuse(scope, send, 401, "invalid_key",
                               "the API key is unknown, revoked or expired")
            return
        state = scope.setdefault("state", {})
        state["key"], state["key_id"] = info, info.id
        if is_upload(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit()
                                     or int(declared) > self.json_max_bytes):
            await self._refuse(scope, send, 413, "too_large", f"a request body is limited to "
                               f"{self.json_max_bytes} bytes (objects: PUT .../objects/KEY)")
            return
        body = bytearray()
        while True:  # read here, up to the cap, and hand the app the same messages
            message = await receive()
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if len(body) > self.json_max_bytes:
                await self._refuse(scope, send, 413, "too_large", f"a request body is limited "
                                   f"to {self.json_max_bytes} bytes")
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, send: Send, status: int, code: str,
                      message: str) -> None:
        for route in self.routes:  # the route it was for, as the metrics and logs label it
            if route.matches(scope)[0] == Match.FULL:
                scope["route"] = route
                break
        body = json.dumps({"error": {"code": code, "message": message}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
