"""API-key check for the routes that run the model when the server has a key (--api-key / TERN_API_KEY); open
otherwise. OpenAI's clients send `Authorization: Bearer <key>`; Anthropic's send `x-api-key: <key>` (or Bearer)."""
from __future__ import annotations

import hmac

from fastapi import Request
from fastapi.security import HTTPBearer

from api.errors import OpenAIError

# Only documents the scheme in /openapi.json; the check itself is authorize(), run before the body is read so
# that a caller without the key learns nothing about the request, not even whether its JSON parses.
bearer_scheme = HTTPBearer(auto_error=False, description="The server's --api-key, when it has one.")


def authorize(request: Request, api_key: str, takes_x_api_key: bool = False) -> None:
    """takes_x_api_key: `x-api-key` is accepted too (the Anthropic Messages routes)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if _matches(token.strip() if scheme.lower() == "bearer" else None, api_key):
        return
    if takes_x_api_key and _matches(request.headers.get("x-api-key"), api_key):
        return
    how = "`x-api-key: <key>` or `Authorization: Bearer <key>`" if takes_x_api_key else "`Authorization: Bearer <key>`"
    raise OpenAIError(401, f"Missing or incorrect API key: send the header {how}.", code="invalid_api_key")


def _matches(given: str | None, api_key: str) -> bool:
    # compare_digest takes as long for a near miss as for a far one, so timing reveals nothing of the key.
    return given is not None and hmac.compare_digest(given.encode(), api_key.encode())
