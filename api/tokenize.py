"""POST /tokenize, POST /detokenize, GET /tokenizer_info: the names lm-evaluation-harness's remote tokenizer probes."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from api.chat import chat_text
from api.errors import OpenAIError
from api.protocol import ChatMessage
from api.reasoning import checked_template_kwargs
from api.bodies import ERRORS
from api.route_context import RouteContext


class TokenizeRequest(BaseModel):
    # Strict types, as api.protocol's bodies; the examples are what /docs shows and the fuzz tests start from.
    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={"examples": [
        {"prompt": "Hello world", "add_special_tokens": False},
        {"messages": [{"role": "user", "content": "Name three birds."}]},
    ]})
    model: str | None = None
    prompt: str | None = Field(None, description="Text to tokenize; or send `messages`.")
    messages: list[ChatMessage] | None = Field(None, description="A chat, tokenized through the chat template.")
    add_special_tokens: bool | None = Field(
        None, description="Default true for `prompt`; false for `messages` (the template writes them)."
    )
    add_generation_prompt: bool = Field(True, description="With `messages`: end with the assistant's turn opener.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="With `messages`: more variables for the chat template, as on chat completions.")


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={"examples": [{"tokens": [19556, 905]}]})
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int = Field(description="The served context length (prompt + completion), in tokens.")
    vocab_size: int


def add_routes(router: APIRouter, context: RouteContext) -> None:
    @router.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS, summary="Text or chat -> token ids")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        engine = (await context.serve(body.model)).engine
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "send exactly one of `prompt` or `messages`", param="prompt")
        if body.messages is not None:
            kwargs = checked_template_kwargs(engine, body.chat_template_kwargs)
            text = chat_text(engine, body.messages, body.add_generation_prompt, template_kwargs=kwargs)
            tokens = engine.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
        else:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            tokens = engine.tokenizer.encode(body.prompt, add_special_tokens=add_special)
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=engine.max_model_len)

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS, summary="Token ids -> text")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        engine = (await context.serve(body.model)).engine
        bad = [t for t in body.tokens if not 0 <= t < engine.tokenizer.vocab_size]
        if bad:
            message = f"token id {bad[0]} is outside the vocabulary (0..{engine.tokenizer.vocab_size - 1})"
            raise OpenAIError(400, message, param="tokens", code="invalid_value")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens, skip_special_tokens=False))

    @router.get("/tokenizer_info", response_model=TokenizerInfo, responses=ERRORS, summary="Special tokens, template")
    async def tokenizer_info(model: str | None = None) -> TokenizerInfo:
        engine = (await context.serve(model)).engine
        tokenizer = engine.tokenizer
        return TokenizerInfo(**tokenizer.special_tokens, chat_template=tokenizer.chat_template,
                             model_max_length=engine.max_model_len, vocab_size=tokenizer.vocab_size)
