"""Typed errors the engine raises for bad requests; the API maps each to a 4xx in OpenAI's shape."""
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


class ModelLoadError(EngineError):
    """The model could not be found or loaded; the message is one line a user can act on."""
