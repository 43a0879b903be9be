"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens): request bodies, the one converter to and
from Tern's chat, routes, response bodies for /openapi.json, and Anthropic's error envelope."""
from __future__ import annotations

from api.anthropic.errors import error_response, response_for_path
from api.anthropic.routes import add_routes, add_unknown_route

__all__ = ["add_routes", "add_unknown_route", "error_response", "response_for_path"]
