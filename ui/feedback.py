"""What a user sees when something is off: the model still loading, or a request the engine refused."""
from __future__ import annotations

import logging

import gradio as gr

from engine import DrainingError, Engine, EngineError, EngineHandle, QueueFullError

logger = logging.getLogger(__name__)


def ready_engine(handle: EngineHandle) -> Engine | None:
    """The engine, or None after telling the user why there is none yet (a toast)."""
    if handle.engine is None:
        gr.Warning(not_ready_message(handle))
    return handle.engine


def not_ready_message(handle: EngineHandle) -> str:
    if handle.error:
        return f"The model failed to load: {handle.error}"
    return "The model is still loading; try again in a few seconds."


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
