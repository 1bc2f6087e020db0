"""What every HTTP request passes before a handler sees it, and the connection-level timeouts.

`RequestGuard` (ASGI middleware), in order:
1. authentication: `/v1/*`, `/tokenize` and `/detokenize` need `Authorization: Bearer <API key>` when keys
   are set; `/admin/*` and the
   context-cache listing need the admin key, or, without one, a loopback peer; `/health`, `/metrics` and
   the OpenAPI schema stay open;
2. a body-carrying method must send `Content-Type: application/json` (415 otherwise: a web page's
   "simple request" cannot reach the API across origins);
3. the body is read here, bounded in size (413, from Content-Length or while it streams, chunked too)
   and in time (408), so a handler only ever sees a complete body of bounded size;
4. response writes that wait on a client that does not read are cut after a timeout;
5. anything a handler lets escape still answers OpenAI error JSON, never a plain-text 500;
6. a `/v1` request passes its tenant's limits (`TenantGate`, tenant_limits.py): 429 with Retry-After beyond.

`GuardedH11Protocol` closes connections that do not finish sending a request's headers in time
(uvicorn's keep-alive timeout stops counting once any byte arrives), refuses heads whose body framing is
ambiguous or invalid with OpenAI error JSON, closing the connection (http_framing.py), and answers 429 on the
connections one client address opens beyond its share (`ConnectionLimiter`), which do not count against the
global cap.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from meshserve.entrypoints.openai.errors import APIError
from meshserve.entrypoints.openai.http_framing import (
    ambiguous_framing_error,
    buffered_head,
    framing_problem,
    head_fields,
)
from meshserve.entrypoints.openai.server_options import ServerOptions, is_loopback_host
from meshserve.entrypoints.openai.tenant_limits import ConnectionLimiter, TenantGate, Ticket, rate_limited

logger = logging.getLogger(__name__)

PRINCIPAL_SCOPE_KEY = "meshserve.principal"
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_JSON_MEDIA_TYPE = "application/json"


@dataclass(frozen=True)
class Principal:
    """Who sent a request: `owner` keys per-client quotas (a key's hash, or the peer address without keys)."""

    owner: str
    is_admin: bool = False


class SlowClientError(Exception):
    """A response write waited longer than the write timeout for the client to read."""


def _key_owner(key: str) -> str:
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _matches(presented: bytes, key: str) -> bool:
    return hmac.compare_digest(presented, key.encode())


class Authenticator:
    """Decides a request's principal, or the 401/403 it gets; keys are compared in constant time."""

    def __init__(self, api_keys: tuple[str, ...], admin_key: str | None) -> None:
        self._api_keys = api_keys
        self._admin_key = admin_key

    def principal(self, scope: dict, bearer: bytes | None) -> Principal:
        path, method = scope["path"], scope["method"]
        peer = (scope.get("client") or ("", 0))[0]
        if is_admin_route(path, method):
            return self._admin(bearer, peer)
        is_admin = bearer is not None and self._admin_key is not None and _matches(bearer, self._admin_key)
        if is_admin:
            return Principal("admin", is_admin=True)
        if not (path.startswith("/v1/") or path in KEYED_ROOT_PATHS) or not self._api_keys:
            return Principal(f"client:{peer}")
        key = self._api_key(bearer)
        if key is None:
            raise _unauthorized("a valid API key (`Authorization: Bearer <key>`) is required.")
        return Principal(_key_owner(key))

    def _admin(self, bearer: bytes | None, peer: str) -> Principal:
        if self._admin_key is None:
            if is_loopback_host(peer):
                return Principal("admin", is_admin=True)
            raise APIError(403, "Admin endpoints answer loopback clients only unless the server has an admin key.",
                           error_type="permission_error")
        if bearer is not None and _matches(bearer, self._admin_key):
            return Principal("admin", is_admin=True)
        if bearer is not None and self._api_key(bearer) is not None:
            raise APIError(403, "This endpoint needs the admin key, not an API key.", error_type="permission_error")
        raise _unauthorized("the admin key (`Authorization: Bearer <admin key>`) is required.")

    def _api_key(self, bearer: bytes | None) -> str | None:
        """The configured key `bearer` equals; every key is compared, so timing does not tell which."""
        if bearer is None:
            return None
        found = None
        for key in self._api_keys:
            if _matches(bearer, key):
                found = key
        return found


# routes outside /v1 the API keys guard as they guard /v1 (they use the model's tokenizer on request)
KEYED_ROOT_PATHS = frozenset({"/tokenize", "/detokenize"})


def is_admin_route(path: str, method: str) -> bool:
    """Operator endpoints and whatever lists cache contents of every client."""
    return path.startswith("/admin/") or (path.rstrip("/") == "/v1/context_caches" and method == "GET")


def _unauthorized(what: str) -> APIError:
    return APIError(401, f"Unauthorized: {what}", error_type="authentication_error", code="invalid_api_key")


def _header(scope: dict, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _bearer(scope: dict) -> bytes | None:
    value = _header(scope, b"authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" and token.strip() else None


def _is_json(content_type: bytes | None) -> bool:
    if content_type is None:
        return False
    media_type = content_type.split(b";", 1)[0].strip().decode("latin-1").lower()
    return media_type == _JSON_MEDIA_TYPE


async def send_error(send: Callable, error: APIError, close: bool = False) -> None:
    """An OpenAI error JSON response straight on the ASGI channel."""
    response = error.to_response({"connection": "close"} if close else None)
    if error.status_code == 401:
        response.headers["www-authenticate"] = "Bearer"
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body, "more_body": False})


class _BodyTooLarge(Exception):
    pass


class RequestGuard:
    """ASGI middleware in front of the API app; `on_reject(reason)` counts what it turns away."""

    def __init__(self, app: Any, options: ServerOptions, on_reject: Callable[[str], None] | None = None,
                 tenant_gate: TenantGate | None = None) -> None:
        self.app = app
        self.options = options
        self.auth = Authenticator(options.api_keys, options.admin_key)
        self.on_reject = on_reject or (lambda reason: None)
        self.tenant_gate = tenant_gate

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            scope[PRINCIPAL_SCOPE_KEY] = self.auth.principal(scope, _bearer(scope))
            self._check_content_type(scope)
            body = await self._read_body(scope, receive)
            ticket = None if body is None else self._tenant_ticket(scope, body)
        except APIError as exc:
            self.on_reject(_REASONS.get(exc.status_code, "other"))
            # a 408's body never came whole: close instead of waiting for the rest
            await send_error(send, exc, close=exc.status_code == 408)
            return
        if body is None:  # the client left while sending its body
            return
        with ticket or contextlib.nullcontext():  # frees the tenant's slot and settles its tokens however it ends
            await self._serve(scope, _replay(body, receive), send)

    def _tenant_ticket(self, scope: dict, body: bytes) -> Ticket | None:
        if self.tenant_gate is None:
            return None
        principal = scope[PRINCIPAL_SCOPE_KEY]
        return self.tenant_gate.admit(principal.owner, principal.is_admin, scope["method"], scope["path"], body)

    async def _serve(self, scope: dict, receive: Callable, send: Callable) -> None:
        state = {"started": False}

        async def guarded_send(message: dict) -> None:
            state["started"] = True
            try:  # any send waits while the client's socket is full (uvicorn's flow control)
                async with asyncio.timeout(self.options.write_timeout_s):
                    await send(message)
            except TimeoutError:
                raise SlowClientError() from None

        try:
            await self.app(scope, receive, guarded_send)
        except SlowClientError:
            self.on_reject("slow_client")
            logger.warning("cut off %s %s: the client read nothing for %g s", scope["method"], scope["path"],
                           self.options.write_timeout_s)
        except Exception as exc:
            if state["started"]:
                raise
            logger.exception("unhandled error in %s %s", scope["method"], scope["path"])
            await send_error(send, APIError(500, f"Internal server error: {type(exc).__name__}"))

    @staticmethod
    def _check_content_type(scope: dict) -> None:
        if scope["method"] in _BODY_METHODS and not _is_json(_header(scope, b"content-type")):
            raise APIError(415, "Unsupported media type: send the request body as `Content-Type: application/json`.",
                           code="unsupported_media_type")

    async def _read_body(self, scope: dict, receive: Callable) -> bytes | None:
        """The whole body (b"" without one), None if the client left; 413 / 408 as APIError.
        Read whatever the headers say: an HTTP/2 body need not declare its length."""
        limit = self.options.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.options.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise _BodyTooLarge()
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except _BodyTooLarge:
            raise _too_large(limit) from None
        except TimeoutError:
            raise APIError(408, f"Request timeout: the body did not arrive within {self.options.body_timeout_s:g} s.",
                           code="request_timeout") from None


_REASONS = {401: "unauthenticated", 403: "forbidden", 408: "body_timeout", 413: "body_too_large",
            415: "unsupported_media_type", 429: "rate_limited"}


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server accepts ({limit} bytes).",
                    code="request_too_large")


def _replay(body: bytes, receive: Callable) -> Callable:
    """A receive that hands the app the body read already, then waits on the client (disconnects)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> dict:
        if pending:
            return pending.pop()
        return await receive()

    return replay


_HEADER_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                            b"connection: close\r\ncontent-length: %d\r\n\r\n%s")


_RAW_RESPONSE = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
                 b"content-length: %d\r\n\r\n%s")


async def _too_many_connections(scope: dict, receive: Callable, send: Callable) -> None:
    error = APIError(503, "The server is at its connection limit; retry later.", code="too_many_connections")
    await send_error(send, error, close=True)


async def _too_many_from_client(scope: dict, receive: Callable, send: Callable) -> None:
    await send_error(send, rate_limited("connections from one client address", 1.0), close=True)


def refusing_ambiguous_framing(app: Callable) -> Callable:
    """`app` behind a check of the parsed headers' framing (a head h11 read without `buffered_head` seeing it)."""

    async def checked(scope: dict, receive: Callable, send: Callable) -> None:
        problem = framing_problem(scope["headers"]) if scope["type"] == "http" else None
        if problem is None:
            await app(scope, receive, send)
        else:
            await send_error(send, ambiguous_framing_error(problem), close=True)

    return checked


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request head in time, refusing
    ambiguous framing, answering requests beyond the connection cap (uvicorn's `limit_concurrency`) and
    requests h11 cannot parse with OpenAI error JSON, and those on a connection beyond its client address's
    share with 429."""

    header_timeout_s = 10.0  # set per server by `protocol_for`
    connection_limiter: ConnectionLimiter | None = None  # likewise; None: the global cap only

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._serving_app = refusing_ambiguous_framing(self.app)
        # the cap is checked here: uvicorn's own check answers in plain text
        self._max_connections, self.limit_concurrency = self.limit_concurrency, None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limiter, self._client_address = self.connection_limiter, "client:" + (self.client or ("", 0))[0]
        self._client_admitted = limiter is None or limiter.try_open(self._client_address)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer(self.header_timeout_s)

    def handle_events(self) -> None:
        head = buffered_head(self.conn)
        problem = None if head is None else framing_problem(head_fields(head))
        if problem is not None:  # before h11 settles on one reading of it
            self._answer_and_close(ambiguous_framing_error(problem))
            return
        cycle = self.cycle
        cap = self._max_connections
        limiter = self.connection_limiter
        # a client's connections beyond its share do not count: they cannot lock the others out
        open_connections = len(self.connections) if limiter is None else limiter.admitted_total
        over = cap is not None and (open_connections >= cap or len(self.tasks) >= cap)
        self.app = _too_many_connections if over else self._serving_app
        if not self._client_admitted:
            self.app = _too_many_from_client
        super().handle_events()
        if self.cycle is not cycle:  # a request head arrived
            self._cancel_header_timer()

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (conflicting lengths, a bad head): uvicorn answers it in plain text."""
        self._answer_and_close(APIError(400, f"Invalid HTTP request: {msg}", code="invalid_http_request"))

    def _answer_and_close(self, error: APIError) -> None:
        """`error` written straight to the socket (no request cycle runs), then the connection closed."""
        self.logger.warning("refused a request: %s", error.message)
        body = error.to_response().body
        self.transport.write(_RAW_RESPONSE % (error.status_code, HTTPStatus(error.status_code).phrase.encode(),
                                              len(body), body))
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():  # the next head may take the keep-alive wait plus the head timeout
            self._arm_header_timer(self.timeout_keep_alive + self.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        if getattr(self, "_client_admitted", False) and self.connection_limiter is not None:
            self.connection_limiter.close(self._client_address)
            self._client_admitted = False
        super().connection_lost(exc)

    def _arm_header_timer(self, delay: float) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(delay, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        """No new request head in time: waiting for one (answer 408), or still draining a refused body."""
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE:
            body = APIError(408, "Request timeout: the request headers did not arrive in time.",
                            code="request_timeout").to_response().body
            self.transport.write(_HEADER_TIMEOUT_RESPONSE % (len(body), body))
        self.transport.close()


def protocol_for(header_timeout_s: float,
                 connection_limiter: ConnectionLimiter | None = None) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn builds per connection, with this server's head timeout and its
    per-client connection limiter."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout_s": header_timeout_s, "connection_limiter": connection_limiter})
