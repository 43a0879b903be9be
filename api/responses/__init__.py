"""The Responses API (/v1/responses): routes, request input, output items, bodies for /openapi.json, the store."""
from __future__ import annotations

from api.responses.routes import add_routes
from api.responses.store import DEFAULT_MAX_STORED_RESPONSES, ResponseStore

__all__ = ["DEFAULT_MAX_STORED_RESPONSES", "ResponseStore", "add_routes"]
