"""The ASGI app a `quasar-hf serve` process listens with, in front of Transformers' OpenAI app.

It answers what no model is needed for and keeps out what a client must not reach:
- `/health`: 503 while the model loads and warms up (and once the server is stopping), then 200;
- the API key (`--api-key`): every path but `/health` needs `Authorization: Bearer KEY` (or `X-API-Key`);
- `/metrics`: Prometheus text from the server's own registry;
- endpoints that would load or unload models (`/load_model`, `/reset`) answer 403, and the schema pages
  (`/docs`, `/redoc`, `/openapi.json`) 404: the server serves one checkpoint and nothing else;
- a request whose client disconnects before its response starts is cancelled (its row stops at the next
  step): Starlette notices a disconnect only while it streams.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

MODEL_CHANGING_PATHS = ("/load_model", "/reset")
HIDDEN_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")
OPEN_PATHS = ("/health",)


async def send_json(send: Send, status: int, payload: dict, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(payload).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def error_payload(message: str, kind: str, code: str | None = None) -> dict:
    """An error body in the OpenAI API's shape."""
    return {"error": {"message": message, "type": kind, "code": code}}


class ServingGate:
    """The served ASGI app: `open(app, alive)` once the model is ready, `close()` when the server stops."""

    def __init__(
        self,
        metrics_body: Callable[[], tuple[bytes, str]],
        api_key: str | None = None,
        on_shutdown: Callable[[], None] | None = None,
    ) -> None:
        self.metrics_body = metrics_body
        self.api_key = api_key
        self.on_shutdown = on_shutdown
        self.app: Any = None
        self.alive: Callable[[], bool] = lambda: False
        self.closing = False

    def open(self, app: Any, alive: Callable[[], bool]) -> None:
        """Start serving `app` (loaded and warmed); `alive()` says whether its worker still runs."""
        self.app, self.alive = app, alive

    def close(self) -> None:
        """From now on /health is 503 and new requests are refused with 503."""
        self.closing = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return None
        path = scope.get("path", "")
        if path in OPEN_PATHS:
            return await self._health(send)
        if self.api_key is not None and not self._authorized(scope):
            payload = error_payload(
                "a valid API key is required: send 'Authorization: Bearer KEY'", "invalid_request_error", "invalid_api_key"
            )
            return await send_json(send, 401, payload, {"WWW-Authenticate": "Bearer"})
        if path in MODEL_CHANGING_PATHS:
            message = "this server serves one checkpoint; to serve another, start quasar-hf serve with it"
            return await send_json(send, 403, error_payload(message, "permission_error"))
        if path in HIDDEN_PATHS:
            return await send_json(send, 404, error_payload(f"{path} is not served", "not_found_error"))
        if path == "/metrics":
            body, content_type = self.metrics_body()
            headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            return await send({"type": "http.response.body", "body": body})
        if self.app is None or self.closing:
            message = "the server is shutting down" if self.closing else "the model is loading; retry shortly"
            return await send_json(send, 503, error_payload(message, "server_unavailable"), {"Retry-After": "5"})
        return await self._forward(scope, receive, send)

    async def _health(self, send: Send) -> None:
        if self.closing:
            return await send_json(send, 503, {"status": "stopping"})
        if self.app is None:
            return await send_json(send, 503, {"status": "loading"})
        if not self.alive():
            return await send_json(send, 503, {"status": "unhealthy", "reason": "the decoding worker stopped"})
        return await send_json(send, 200, {"status": "ok"})

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-api-key", b"").decode("latin-1")
        bearer = headers.get(b"authorization", b"").decode("latin-1")
        if bearer.lower().startswith("bearer "):
            given = bearer[7:].strip()
        return hmac.compare_digest(given.encode(), str(self.api_key).encode())

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.on_shutdown is not None:
                    self.on_shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the inner app on the whole request body; cancel it if the client leaves before the response starts."""
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body, replayed, started = b"".join(chunks), False, False
        disconnected = asyncio.Event()

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected.set()

        async def tracked_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        app_task = asyncio.ensure_future(self.app(scope, replay, tracked_send))
        watch_task = asyncio.ensure_future(watch())
        try:
            done, _ = await asyncio.wait({app_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
            if app_task not in done and not started:
                app_task.cancel()  # the client left before any response: its request is cancelled
            try:
                await app_task
            except asyncio.CancelledError:
                if not disconnected.is_set():
                    raise
        finally:
            watch_task.cancel()
