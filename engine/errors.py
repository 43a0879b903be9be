"""Typed errors the engine raises: bad requests (the API answers a 4xx in OpenAI's shape), a full queue (429), a
failed step (500) and a model that would not load (503)."""
from __future__ import annotations


class EngineError(Exception):
    """Base class. `param` names the request field at fault, when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(EngineError):
    """The request cannot be served as asked (out-of-range value, unknown token id, ...)."""


class ContextLengthExceededError(InvalidRequestError):
    """Prompt plus requested tokens do not fit in the model's context."""


class NoChatTemplateError(InvalidRequestError):
    """A chat request reached a model whose tokenizer has no chat template."""


class GrammarError(InvalidRequestError):
    """A response format (JSON schema) that cannot be compiled to a grammar; the message names the problem."""


class QueueFullError(EngineError):
    """Too many requests are waiting; the client should retry later."""


class DrainingError(EngineError):
    """The engine is draining (the server is shutting down): it finishes what runs and takes nothing new."""


class StepFailedError(EngineError):
    """A step the request was part of raised (a model or kernel bug, not the request's fault): the request ends
    with this error, its KV blocks are freed, and the engine goes on serving. The cause is chained and logged."""


class ModelLoadError(EngineError):
    """The model could not be found or loaded; the message is one line a user can act on."""
