"""agentx errors as OpenAI API errors: an HTTP status and the ``{"error": {...}}`` body.

The ``openai`` client turns the status into its exception class (400 ``BadRequestError``, 401
``AuthenticationError``, 404 ``NotFoundError``, 413 and 499 ``APIStatusError``, 5xx
``InternalServerError``), so the in-process client and ``agentx serve`` raise the same ones::

    InvalidRequestError (and its subclasses)   400 invalid_request_error
    RecursionError (a body nested too deeply)  400 invalid_request_error
        PromptTooLongError                          code context_length_exceeded
    RequestAbortedError                        499 request_aborted
    EngineClosedError, EngineDeadError         503 server_error
    RequestFailedError                         500 server_error, code request_failed
    any other exception                        500 server_error

It owns that table only; it does not know HTTP frameworks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentx.errors import (
    EngineClosedError,
    EngineDeadError,
    InvalidRequestError,
    PromptTooLongError,
    RequestAbortedError,
    RequestFailedError,
)

__all__ = ["APIErrorBody", "error_body", "to_api_error"]


@dataclass(frozen=True, slots=True)
class APIErrorBody:
    status: int
    body: dict[str, Any]


def error_body(
    status: int, message: str, kind: str, code: str | None = None, param: str | None = None
) -> APIErrorBody:
    return APIErrorBody(
        status, {"error": {"message": message, "type": kind, "param": param, "code": code}}
    )


def to_api_error(exc: BaseException) -> APIErrorBody:
    """The status and body an exception raised while serving a request answers with."""
    if isinstance(exc, PromptTooLongError):
        return error_body(400, str(exc), "invalid_request_error", "context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return error_body(400, str(exc), "invalid_request_error")
    if isinstance(exc, RecursionError):  # a body nested deeper than Python recurses
        return error_body(400, "the request is nested too deeply", "invalid_request_error")
    if isinstance(exc, RequestAbortedError):
        return error_body(499, str(exc) or "the request was aborted", "request_aborted")
    if isinstance(exc, RequestFailedError):
        return error_body(500, str(exc), "server_error", "request_failed")
    if isinstance(exc, EngineClosedError | EngineDeadError):
        return error_body(503, str(exc), "server_error", "engine_unavailable")
    return error_body(500, f"{type(exc).__name__}: {exc}", "server_error")
