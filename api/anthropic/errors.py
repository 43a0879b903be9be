"""Anthropic's error envelope, {"type": "error", "error": {"type", "message"}}, for every failure on /v1/messages:
the same OpenAIError every route raises (api/errors.py decides status and message), written in Anthropic's words."""
from __future__ import annotations

from fastapi.responses import JSONResponse

from api.errors import OpenAIError

PATH_PREFIX = "/v1/messages"

# Anthropic's error types by HTTP status (docs.anthropic.com/en/api/errors); 529 is its own "overloaded", and Tern's
# 503 (loading, draining) means the same to a client: retry later.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status_code: int) -> str:
    if status_code in _TYPES:
        return _TYPES[status_code]
    return "invalid_request_error" if status_code < 500 else "api_error"


def error_body(error: OpenAIError) -> dict:
    return {"type": "error", "error": {"type": error_type(error.status_code), "message": error.message}}


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status_code, headers=error.headers)


def response_for_path(path: str, error: OpenAIError) -> JSONResponse:
    """The error in the shape the path's clients read: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    if path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/"):
        return error_response(error)
    return error.response()
