"""OpenAI-style error JSON, and which HTTP status each failure maps to.

Every error the API returns has the body OpenAI clients parse:
`{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`, with
OpenAI's error types (`invalid_request_error`, `authentication_error`,
`permission_error`, `not_found_error`, `rate_limit_exceeded`, `server_error`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from meshserve.wire.errors import EngineDeadError, InvalidRequestError, QueueFullError, RequestTooLongError
from meshserve.wire.sampling_params import SamplingParamsError

logger = logging.getLogger(__name__)

_DEFAULT_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable_error",
}


def default_error_type(status_code: int) -> str:
    """OpenAI's error type for a status: client errors are invalid requests, server errors server errors."""
    if status_code in _DEFAULT_TYPES:
        return _DEFAULT_TYPES[status_code]
    return "server_error" if status_code >= 500 else "invalid_request_error"


class APIError(Exception):
    """A failure the client sees as an HTTP status with an OpenAI error body."""

    def __init__(self, status_code: int, message: str, *, error_type: str | None = None,
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.error_type = error_type or default_error_type(status_code)
        self.param = param
        self.code = code
        self.headers = headers or {}  # e.g. a 429's Retry-After

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def to_response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.to_dict(), status_code=self.status_code, headers={**self.headers, **(headers or {})})


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def from_validation_error(err: ValidationError) -> APIError:
    """A 400 naming the first offending field, in words a client can act on."""
    details = err.errors(include_url=False)
    messages = [_describe(d) for d in details]
    first_loc = details[0]["loc"] if details else ()
    return bad_request("; ".join(messages), param=_dotted(first_loc) or None)


def _describe(detail: dict[str, Any]) -> str:
    loc = _dotted(detail["loc"])
    kind = detail["type"]
    if kind == "json_invalid":
        return f"The request body is not valid JSON: {detail.get('ctx', {}).get('error', detail['msg'])}"
    if kind == "model_type" and not loc:
        return "The request body must be a JSON object."
    if kind == "missing":
        return f"Missing required parameter: '{loc}'."
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: '{loc}'."
    msg = detail["msg"].removeprefix("Value error, ")
    return f"Invalid value for '{loc}': {msg}." if loc else f"{msg}."


# the names pydantic gives the members of a union in an error's location; no field is called so
_UNION_MEMBER_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def _dotted(loc: tuple) -> str:
    """`messages[1].content`, as OpenAI names a nested parameter (union member tags left out)."""
    out = ""
    for part in loc:
        if isinstance(part, str) and (part in _UNION_MEMBER_TAGS or "[" in part or "-" in part):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def engine_dead(reason: object) -> APIError:
    return APIError(503, f"The engine is not running: {reason}", code="engine_dead")


def _queue_full(exc: QueueFullError, max_queue_hint: int | None) -> APIError:
    limit = f" (at most {max_queue_hint} requests may wait)" if max_queue_hint else ""
    reason = str(exc) or "the waiting queue is full"
    return APIError(503, f"The server is overloaded: {reason}{limit}. Retry later.", code="queue_full")


# the engine's errors (admission refusals included) by class; a subclass maps as its nearest listed base
_ENGINE_ERRORS: dict[type[BaseException], Callable[[Any, int | None], APIError]] = {
    APIError: lambda exc, _: exc,
    ValidationError: lambda exc, _: from_validation_error(exc),
    SamplingParamsError: lambda exc, _: bad_request(str(exc), param=exc.param),
    RequestTooLongError: lambda exc, _: bad_request(str(exc), code="context_length_exceeded"),
    InvalidRequestError: lambda exc, _: bad_request(str(exc)),  # e.g. a token id outside the vocabulary
    QueueFullError: _queue_full,
    EngineDeadError: lambda exc, _: engine_dead(exc),
}


def from_exception(exc: BaseException, *, max_queue_hint: int | None = None) -> APIError:
    """Map anything a request handler can raise to the status the client should see."""
    for cls in type(exc).__mro__:
        if cls in _ENGINE_ERRORS:
            return _ENGINE_ERRORS[cls](exc, max_queue_hint)
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return APIError(500, f"Internal server error: {type(exc).__name__}: {exc}")


def install_error_handlers(app: FastAPI) -> None:
    """Make framework-level failures (unknown route, wrong method, bad body) speak OpenAI error JSON too."""

    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.to_response()

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code in (404, 405):  # OpenAI's words for an unknown route or method
            message = f"Invalid URL ({request.method} {request.url.path}): {message}."
        return APIError(exc.status_code, message).to_response(headers=getattr(exc, "headers", None))

    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI would answer 422; OpenAI answers 400
        messages = [_describe({**d, "loc": tuple(d["loc"][1:])}) for d in exc.errors()]
        return bad_request("; ".join(messages)).to_response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
