"""Bearer-key check for /v1 when the server has an API key (--api-key / TERN_API_KEY); open otherwise."""
from __future__ import annotations

import hmac

from fastapi import Request
from fastapi.security import HTTPBearer

from api.errors import OpenAIError

# Only documents the scheme in /openapi.json; the check itself is authorize(), run before the body is read so
# that a caller without the key learns nothing about the request, not even whether its JSON parses.
bearer_scheme = HTTPBearer(auto_error=False, description="The server's --api-key, when it has one.")


def authorize(request: Request, api_key: str) -> None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # compare_digest takes as long for a near miss as for a far one, so timing reveals nothing of the key.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise OpenAIError(
            401,
            "Missing or incorrect API key: send the header `Authorization: Bearer <key>`.",
            code="invalid_api_key",
        )
