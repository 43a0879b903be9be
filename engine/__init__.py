"""Tern's decode engine: paged KV cache, continuous batching, sampling, stops, logprobs and embeddings. No web code
here."""
from engine.config import EngineConfig
from engine.engine import Engine
from engine.handle import EngineHandle
from engine.info import EngineInfo, EngineStats
from engine.errors import (
    ContextLengthExceededError,
    DrainingError,
    EngineError,
    GrammarError,
    InvalidRequestError,
    ModelLoadError,
    NoChatTemplateError,
    QueueFullError,
    StepFailedError,
)
from engine.outputs import FINISH_ABORT, Choice, Completion, ContinuationScore, Embedding, RequestOutput
from engine.params import SamplingParams
from engine.request import TokenLogprob

__all__ = [
    "FINISH_ABORT",
    "Choice",
    "Completion",
    "ContextLengthExceededError",
    "ContinuationScore",
    "DrainingError",
    "Embedding",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineHandle",
    "EngineInfo",
    "EngineStats",
    "GrammarError",
    "InvalidRequestError",
    "ModelLoadError",
    "NoChatTemplateError",
    "QueueFullError",
    "RequestOutput",
    "SamplingParams",
    "StepFailedError",
    "TokenLogprob",
]
