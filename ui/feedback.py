"""What a user sees when something is off: a model that cannot serve (still loading, failed), or a request the
engine refused."""
from __future__ import annotations

import logging

import gradio as gr

from engine import DrainingError, EngineError, QueueFullError

logger = logging.getLogger(__name__)


def report_error(exc: Exception) -> str:
    """Toast a readable message for a failed request and return it as inline Markdown; never a stack trace."""
    if isinstance(exc, QueueFullError):
        message = "The server is busy (too many requests are waiting). Try again in a moment."
    elif isinstance(exc, DrainingError):
        message = "The server is shutting down and takes no new requests. Try again in a moment."
    elif isinstance(exc, EngineError):
        message = exc.message
    else:
        logger.exception("request failed in the UI", exc_info=exc)
        message = f"Generation failed: {type(exc).__name__}: {exc}"
    gr.Warning(message)
    return f"\u26a0\ufe0f {message}"
