"""Response bodies of chat, completions, models and errors in OpenAI's shapes, for /openapi.json and for building
non-streamed answers (the Responses API's own shapes are in api/responses/output.py)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

# "abort": the server shut down before the sample finished (SGLang's name; OpenAI has none), in a stream only.
FinishReason = Literal["stop", "length", "tool_calls", "abort"]
CompletionFinishReason = Literal["stop", "length", "abort"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens whose KV the prefix cache held (not computed again).")


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = Field(description="Completion tokens of a thinking model's reasoning, its tags included.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str = Field(description="The token as decoded text (a piece of a UTF-8 character decodes to U+FFFD).")
    logprob: float = Field(description="Of the model's raw distribution; -9999.0 stands for minus infinity.")
    bytes: list[int] | None = Field(description="The token's exact UTF-8 bytes.")


class ChatCompletionTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatCompletionTokenLogprob] | None
    refusal: None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str = Field(description="JSON text, valid against the function's parameters when a call was "
                           "required or named (or under auto, once the model wrote the opening tag).")


class ToolCallOut(BaseModel):
    id: str = Field(description="call_...")
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="null when the reply is only tool calls.")
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = Field(
        None, description="Extension (vLLM's name): a thinking model's reasoning, from between <think> and </think>; "
        "null when the reply has none. `content` then holds only the answer.")


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None


class ChatCompletion(BaseModel):
    id: str = Field(description="chatcmpl-...")
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = Field(None, description="On a call's first delta.")
    arguments: str | None = Field(None, description="A fragment of the arguments' JSON text (Tern sends a call whole, "
                                  "in one delta, once its arguments are complete).")


class ToolCallDelta(BaseModel):
    index: int = Field(description="Which call of the reply, from 0.")
    id: str | None = Field(None, description="On a call's first delta.")
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = Field(None, description="Extension: a piece of a thinking model's reasoning.")
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a streamed chat completion; every chunk of a stream shares id and created."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, description="Only with stream_options.include_usage: null, then set on a "
                                "last chunk with `choices: []`.")


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="With echo, the first prompt token's is null.")
    top_logprobs: list[dict[str, float] | None] = Field(
        description="Token -> logprob for the requested alternatives plus the chosen token; null for the first "
        "prompt token, which has no context."
    )
    text_offset: list[int] = Field(
        description="Where each token's text begins in the prompt followed by the completion (characters), echoed or not."
    )


class CompletionChoice(BaseModel):
    index: int = Field(description="prompt_index * n + sample_index")
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: CompletionFinishReason | None


class TextCompletion(BaseModel):
    """Also the shape of each streamed event, where `usage` is absent, or with stream_options.include_usage null until
    a last chunk with `choices: []` (as OpenAI streams it)."""

    id: str = Field(description="cmpl-...")
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, description="Always set on a whole answer; in a stream see above.")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    state: str = Field("loaded", description="loaded, loading, unloaded (loads when a request names it), unloading "
                       "or failed (see error). The engine's fields below are null unless loaded.")
    error: str | None = Field(None, description="Why the model failed to load.")
    max_model_len: int | None = Field(None, description="Longest prompt + completion, in tokens.")
    dtype: str | None = Field(None, description="Compute dtype, e.g. bfloat16.")
    quantization: str | None = Field(None, description="Weight quantization mode: none, int8, int4, bnb-int8, bnb-nf4 "
                                     "or bnb-fp4 (what --quantization auto chose, when it was auto).")
    weight_bytes: int | None = Field(None, description="Bytes the weights occupy, quantized storage and scales "
                                     "included.")
    weight_ratio_to_bf16: float | None = Field(None, description="weight_bytes over the same weights in bf16.")
    kv_cache_bytes: int | None = Field(None, description="Bytes of the KV cache's pool, allocated at start.")
    kv_cache_dtype: str | None = Field(None, description="The dtype keys and values are stored in (--kv-cache-dtype), "
                                       "e.g. bfloat16; none where the model keeps no cache.")
    kv_cache_resident: bool | None = Field(None, description="Whether every page of the KV cache's pool is in memory: "
                                           "on a CPU the pool faults in on a background thread for a second or so "
                                           "after the model is ready.")
    weights_settled: bool | None = Field(None, description="Whether the weights' move into huge pages after start "
                                         "has ended (or none was due): on a CPU the weights load in 4 KB pages and a "
                                         "background thread collapses them into 2 MB ones after the pool is resident.")
    compiled_decode: bool | None = Field(None, description="Whether decode steps run under torch.compile (--compile).")
    decode_step: str | None = Field(None, description="native (Tern's C++ decode step), compiled, compiling (the "
                                    "eager step serves until the compiled one is ready) or eager.")
    cpu_kernels: str | None = Field(None, description="The CPU kernel path and what serves each kind of work, e.g. "
                                    "`avx2 (int8: avx2, int4: avx2, bf16: avx2-fma, decode attention: avx2)`.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# Every error has this body. "4XX" also keeps FastAPI from documenting its 422, which clients never get.
ERRORS = {
    400: {"model": ErrorResponse, "description": "Malformed JSON, a wrong type, an out-of-range value, too long"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key (when the server has one)"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    429: {"model": ErrorResponse, "description": "Too many requests waiting; retry after Retry-After seconds"},
    503: {"model": ErrorResponse, "description": "The model is still loading"},
    "4XX": {"model": ErrorResponse, "description": "Any other client error"},
}


def streamed(chunk: type[BaseModel]) -> dict:
    """OpenAPI `responses` entry for a route that also streams: its 200 is JSON, or with stream: true an event stream
    described as OpenAPI 3.2 does (and FastAPI for its own SSE routes): `itemSchema` is one event, whose `data` is
    JSON of the chunk's schema, an error in the error body's shape (a failure after the first event), or [DONE]."""
    description = (f"application/json: the whole answer. With stream: true, text/event-stream: `data: <{chunk.__name__}>` "
                   "events, an `ErrorResponse` event if the request fails once streaming, then `data: [DONE]`.")
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [inline(chunk.model_json_schema()), inline(ErrorResponse.model_json_schema())]},
    }
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {"anyOf": [json_data, {"const": "[DONE]"}]},
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer", "minimum": 0},
        },
    }
    return {200: {"description": description, "content": {"text/event-stream": {"itemSchema": event}}}, **ERRORS}


def inline(schema: dict) -> dict:
    """Resolve pydantic's local $refs so the schema stands on its own inside an operation."""
    defs = schema.pop("$defs", {})

    def resolve(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return resolve(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {key: resolve(value) for key, value in node.items()}
        if isinstance(node, list):
            return [resolve(item) for item in node]
        return node

    return resolve(schema)
