"""One error shape for every failure: {"error": {"message", "type", "param", "code"}}, mapped from any exception."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from engine import (
    ContextLengthExceededError,
    DrainingError,
    EngineError,
    ModelLoadError,
    NoChatTemplateError,
    QueueFullError,
    StepFailedError,
)
from engine.registry import ModelFailedError, ModelNotReadyError, UnknownModelError

logger = logging.getLogger(__name__)

# Seconds a client should wait before retrying a 429 (queue full) or a 503 (model loading, shutting down).
RETRY_AFTER_S = 1

# Pydantic tags a union member in an error's location (("prompt", "list[int]", 0)); they are no field names.
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


class OpenAIError(Exception):
    """A failure with its HTTP status and OpenAI's error fields; raise it from a route to answer it."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code, self.message, self.type, self.param, self.code = status_code, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


class RequestTooLargeError(HTTPException):
    """The request body is over --max-body-size. An HTTPException, so FastAPI's body reading passes it on as is."""

    def __init__(self, max_body_size_bytes: int) -> None:
        message = (f"The request body is larger than this server's limit of {max_body_size_bytes} bytes "
                   "(--max-body-size); send fewer or shorter prompts.")
        super().__init__(413, message)


class ClientDisconnected(Exception):
    """The client went away before its answer was ready; its engine requests were aborted."""


def to_openai_error(exc: Exception) -> OpenAIError:
    """Any exception a route can raise, as the OpenAIError a client sees. Only our own bugs become a 500."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RequestValidationError):
        return _from_validation(exc.errors())
    if isinstance(exc, EngineError):
        return _from_engine(exc)
    if isinstance(exc, ClientDisconnected):
        # nginx's "client closed request": only our logs and metrics ever see it.
        return OpenAIError(499, "the client closed the connection", "client_closed_request")
    if isinstance(exc, RequestTooLargeError):
        return OpenAIError(413, str(exc.detail), code="request_too_large")
    if isinstance(exc, HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return OpenAIError(exc.status_code, str(exc.detail), kind, headers=exc.headers)
    logger.exception("unexpected error", exc_info=exc)
    return OpenAIError(500, f"internal error ({type(exc).__name__}); see the server log", "server_error")


def install_error_handlers(app: FastAPI) -> None:
    """Give errors raised outside our routes' own handling the same shape (never FastAPI's 422 `detail`)."""

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        return to_openai_error(exc).response()

    for exc_class in (OpenAIError, RequestValidationError, EngineError, HTTPException, Exception):
        app.add_exception_handler(exc_class, handle)


def model_loading(reason: str | None) -> OpenAIError:
    message = f"the model failed to load: {reason}" if reason else "the model is still loading; retry shortly"
    return OpenAIError(503, message, "service_unavailable_error", code="model_not_ready", headers=_retry_after())


def shutting_down(message: str = "the server is shutting down and takes no new requests; retry shortly") -> OpenAIError:
    """503 while the server drains: a retry reaches another replica, or this one restarted."""
    return OpenAIError(503, message, "service_unavailable_error", code="server_shutting_down", headers=_retry_after())


def _from_engine(exc: EngineError) -> OpenAIError:
    if isinstance(exc, DrainingError):
        return shutting_down()
    if isinstance(exc, UnknownModelError):
        return OpenAIError(404, exc.message, param="model", code="model_not_found")
    if isinstance(exc, (ModelNotReadyError, ModelFailedError)):  # the message names the model (and why it failed)
        return OpenAIError(503, exc.message, "service_unavailable_error", code="model_not_ready",
                           headers=_retry_after())
    if isinstance(exc, QueueFullError):
        return OpenAIError(429, exc.message, "rate_limit_error", code="rate_limit_exceeded", headers=_retry_after())
    if isinstance(exc, ModelLoadError):
        return model_loading(exc.message)
    if isinstance(exc, StepFailedError):  # the engine logged the traceback; the client learns what it can do
        return OpenAIError(500, exc.message, "server_error")
    code = "invalid_value"
    if isinstance(exc, ContextLengthExceededError):
        code = "context_length_exceeded"
    elif isinstance(exc, NoChatTemplateError):
        code = "chat_template_missing"
    return OpenAIError(400, exc.message, "invalid_request_error", exc.param, code)


def _from_validation(errors: list[dict]) -> OpenAIError:
    """Pydantic's errors -> one 400 naming the first field at fault, as `messages[0].content`."""
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", "invalid JSON")
        message = f"We could not parse the JSON body of your request ({detail} at position {first['loc'][-1]})."
        return OpenAIError(400, message)
    path, tags = _split_loc(first["loc"])
    param = _format_param(path)
    if not path:
        if first["type"] == "missing":
            return OpenAIError(400, "Missing request body: expected a JSON object.", code="missing_required_parameter")
        message = "The request body must be a JSON object (send it with Content-Type: application/json)."
        return OpenAIError(400, message, code="invalid_type")
    if first["type"] == "missing":
        return OpenAIError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    if tags:  # a union (prompt: str | list[str] | ...): say which shapes would have been accepted
        accepted = []
        for error in errors:
            other_path, other_tags = _split_loc(error["loc"])
            if other_path == path and other_tags and other_tags[0] not in accepted:
                accepted.append(other_tags[0])
        message = f"Invalid type for '{param}': expected one of {', '.join(accepted)}."
        return OpenAIError(400, message, param=param, code="invalid_type")
    is_type_error = first["type"].endswith(("_type", "_parsing"))
    message = f"Invalid {'type' if is_type_error else 'value'} for '{param}': {first['msg']}."
    return OpenAIError(400, message, param=param, code="invalid_type" if is_type_error else "invalid_value")


def _split_loc(loc) -> tuple[list, list[str]]:
    """(path up to the first union tag, the tags), without FastAPI's leading "body"."""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    for i, part in enumerate(parts):
        if isinstance(part, str) and (part in _TYPE_TAGS or not part.isidentifier()):
            return parts[:i], [p for p in parts[i:] if isinstance(p, str)]
    return parts, []


def _format_param(path: list) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _retry_after() -> dict[str, str]:
    return {"Retry-After": str(RETRY_AFTER_S)}
