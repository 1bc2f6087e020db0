"""Errors the engine raises to its callers (the API maps each to an HTTP status)."""
from __future__ import annotations

from meshserve.wire.sampling_params import SamplingParamsError


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit (HTTP 503)."""


class RequestTooLongError(ValueError):
    """Prompt plus max_tokens cannot fit the context or the KV pool (HTTP 400)."""


class InvalidRequestError(ValueError):
    """A request names something the model does not have (a token id outside its vocabulary) or a
    malformed field (HTTP 400)."""


class EngineDeadError(RuntimeError):
    """The engine (master or an worker) has died; no request can be served (HTTP 503)."""


# errors the master reports by class name when it refuses a request at admission
ADMISSION_ERRORS: dict[str, type[Exception]] = {
    "QueueFullError": QueueFullError, "RequestTooLongError": RequestTooLongError,
    "InvalidRequestError": InvalidRequestError, "SamplingParamsError": SamplingParamsError}
