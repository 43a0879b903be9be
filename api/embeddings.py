"""POST /v1/embeddings: one L2-normalised vector per input, pooled by the engine (engine/pooling.py), as floats or as
base64 of little-endian float32 (what the openai SDK asks for unless told otherwise)."""
from __future__ import annotations

import base64
import logging
import struct
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from engine import Embedding, Engine, EngineError

from api.bodies import ERRORS
from api.errors import OpenAIError
from api.generation import until_disconnected
from api.protocol import MAX_PROMPTS
from api.route_context import RouteContext

logger = logging.getLogger(__name__)


class EmbeddingRequest(BaseModel):
    # Strict types, as api.protocol's bodies; the examples are what /docs shows and the fuzz tests start from.
    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={"examples": [
        {"input": ["The food was delicious.", "The service was slow."]},
        {"input": [[504, 2365, 436], [504, 2365]], "encoding_format": "base64"},
    ]})
    model: str | None = Field(None, description="The served model id (GET /v1/models); defaults to it.")
    input: list[list[int]] | list[int] | list[str] | str = Field(
        description=f"A string, a list of strings, a list of token ids (used exactly: no BOS is added), or a list of "
        f"such lists; at most {MAX_PROMPTS} inputs, none empty, each within the model's context length."
    )
    encoding_format: Literal["float", "base64"] | None = Field(
        None, description="\"float\" (default): lists of numbers; \"base64\": little-endian float32 bytes, base64."
    )
    dimensions: int | None = Field(None, description="Accepted only when equal to the model's hidden size.")
    user: str | None = Field(None, description="Accepted for compatibility; unused.")


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="Unit length; base64 of float32 with encoding_format base64.")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def add_routes(router: APIRouter, context: RouteContext) -> None:
    @router.post(
        "/v1/embeddings",
        response_model=EmbeddingList,
        responses=ERRORS,
        summary="Create embeddings",
        description="Each input's vector is the model's final hidden state (after its final norm) of the input's "
        "last token, L2-normalised, unless the checkpoint's sentence-transformers pooling config asks for another "
        "method. Inputs are prefilled through the same scheduler as completions, beside running streams.",
    )
    async def create_embedding(body: EmbeddingRequest, request: Request) -> EmbeddingList:
        served = await context.serve(body.model)
        engine = served.engine
        if body.dimensions is not None and body.dimensions != engine.hidden_size:
            message = (f"This model's embeddings have {engine.hidden_size} dimensions and cannot be shortened: "
                       f"send dimensions {engine.hidden_size} or leave it out (got {body.dimensions}).")
            raise OpenAIError(400, message, param="dimensions", code="invalid_value")
        prompt_ids = _prompt_ids(engine, _inputs(body.input))
        try:
            embeddings = await until_disconnected(request, engine.embed(prompt_ids))
        except EngineError as exc:
            if exc.param == "prompt":  # the engine's name for what this route calls input
                exc.param = "input"
            raise
        num_tokens = sum(e.num_prompt_tokens for e in embeddings)
        served.metrics.prompt_tokens.inc(num_tokens)
        logger.info("%s embeddings: %d inputs, %d tokens", request.state.request_id, len(embeddings), num_tokens)
        data = [EmbeddingData(index=i, embedding=_encoded(e, body.encoding_format)) for i, e in enumerate(embeddings)]
        return EmbeddingList(data=data, model=served.model_id,
                             usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))


def _inputs(value: list[list[int]] | list[int] | list[str] | str) -> list[str | list[int]]:
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        inputs = [value]
    else:
        inputs = list(value)
    if not inputs:
        raise OpenAIError(400, "input must not be empty: send a string, or a list of strings or token ids",
                          param="input", code="invalid_value")
    if len(inputs) > MAX_PROMPTS:
        message = f"at most {MAX_PROMPTS} inputs per request, got {len(inputs)}; send the rest in another request"
        raise OpenAIError(400, message, param="input", code="invalid_value")
    for i, item in enumerate(inputs):
        if not item:
            what = "an empty string" if isinstance(item, str) else "an empty list of token ids"
            name = "input" if len(inputs) == 1 and value is item else f"input[{i}]"
            raise OpenAIError(400, f"{name} is {what}: every input needs at least one token", param="input",
                              code="invalid_value")
    return inputs


def _prompt_ids(engine: Engine, inputs: list[str | list[int]]) -> list[list[int]]:
    """Text tokenized as a completion prompt is (with the tokenizer's special tokens); token ids used as given."""
    prompt_ids = [engine.tokenizer.encode(item) if isinstance(item, str) else item for item in inputs]
    for i, ids in enumerate(prompt_ids):
        if len(ids) > engine.max_model_len:
            message = (f"This model's maximum context length is {engine.max_model_len} tokens, and input[{i}] has "
                       f"{len(ids)}. Shorten it or split it into several inputs.")
            raise OpenAIError(400, message, param="input", code="context_length_exceeded")
    return prompt_ids


def _encoded(embedding: Embedding, encoding_format: str | None) -> list[float] | str:
    if encoding_format == "base64":
        little_endian_float32 = struct.pack(f"<{len(embedding.vector)}f", *embedding.vector)
        return base64.b64encode(little_endian_float32).decode("ascii")
    return embedding.vector
