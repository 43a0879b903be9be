"""Tern's decode engine: paged KV cache, continuous batching, sampling, stops and logprobs. No web code here."""
from engine.config import EngineConfig
from engine.engine import Engine, EngineStats
from engine.handle import EngineHandle
from engine.errors import (
    ContextLengthExceededError,
    EngineError,
    GrammarError,
    InvalidRequestError,
    ModelLoadError,
    NoChatTemplateError,
    QueueFullError,
)
from engine.outputs import Choice, Completion, ContinuationScore, RequestOutput
from engine.params import SamplingParams
from engine.request import TokenLogprob

__all__ = [
    "Choice",
    "Completion",
    "ContextLengthExceededError",
    "ContinuationScore",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineHandle",
    "EngineStats",
    "GrammarError",
    "InvalidRequestError",
    "ModelLoadError",
    "NoChatTemplateError",
    "QueueFullError",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]
