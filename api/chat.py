"""POST /v1/chat/completions: render the chat template, generate, answer as one JSON body or as SSE chunks."""
from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from engine import Engine, EngineError, SamplingParams

from api import function_tools, reasoning
from api.errors import OpenAIError
from api.generation import Generation, Sample, until_disconnected
from api.logprobs import chat_logprobs, visible_logprobs
from api.protocol import ChatCompletionRequest, ChatMessage, template_messages
from api.reasoning import ReplyReasoning
from api.response_format import AnswerFormat, chat_format, grammar_for
from api.bodies import (
    ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta, ChatMessageOut, streamed,
)
from api.route_context import RouteContext, Served
from api.sse import event_stream


def add_routes(router: APIRouter, context: RouteContext) -> None:
    @router.post(
        "/v1/chat/completions",
        response_model=ChatCompletion,
        responses=streamed(ChatCompletionChunk),
        summary="Create a chat completion",
    )
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        served = await context.serve(body.model)
        engine = served.engine
        params = body.to_sampling_params()
        tools = chat_tools(body)
        messages = template_messages(body.messages)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        template_kwargs = reasoning.checked_template_kwargs(engine, body.chat_template_kwargs)
        generation, split = await start_chat(served, messages, params, tools,
                                             chat_format(body.response_format), response_id, request, template_kwargs)
        head = {"id": response_id, "created": int(time.time()), "model": served.model_id}
        if body.stream:
            return event_stream(_chunks(generation, head, body, engine, tools, split))
        samples = await until_disconnected(request, generation.collect())
        choices = [_choice(sample, bool(body.logprobs), engine, tools, split) for sample in samples]
        thinking = sum(reasoning.reasoning_tokens(split, sample.token_ids, choice.message.reasoning_content is not None)
                       for sample, choice in zip(samples, choices))
        return ChatCompletion(**head, choices=choices, usage=_usage(generation, thinking))


async def start_chat(served: Served, messages: list[dict], params: SamplingParams,
                     tools: function_tools.Tools, answer: AnswerFormat, response_id: str, request: Request,
                     template_kwargs: dict | None = None) -> tuple[Generation, ReplyReasoning | None]:
    """A chat's generation, submitted: the prompt rendered with the tools it may call (and the client's template
    variables), the reply's grammar compiled; with how its reply splits into reasoning and answer (None: it does
    not). Chat, the Responses API and Anthropic's Messages all start here."""
    engine = served.engine
    constrained = reasoning.is_constrained(answer, tools)
    prompt_text, prompt_ids = chat_prompt(engine, messages, tools, constrained, template_kwargs)
    split = reasoning.reply_reasoning(engine, prompt_text, constrained)
    params = dataclasses.replace(params, grammar=await grammar_for(engine, answer, tools))
    try:
        return Generation(engine, [prompt_ids], params, response_id, served.metrics, request.state.request_id), split
    except EngineError as exc:
        if exc.param == "prompt":  # the engine saw a prompt; the client sent messages
            exc.param = "messages"
        raise


def chat_tools(body: ChatCompletionRequest) -> function_tools.Tools:
    definitions = [(t.function.name, t.function.description, t.function.parameters) for t in body.tools or []]
    for i, tool in enumerate(body.tools or []):
        if tool.type != "function":
            message = f"tools of type {tool.type!r} are not supported; only \"function\""
            raise OpenAIError(400, message, param=f"tools[{i}].type", code="unsupported_parameter")
    choice, name = body.tool_choice, None
    if choice is not None and not isinstance(choice, str):
        if choice.type != "function":
            raise OpenAIError(400, f"tool_choice of type {choice.type!r} is not supported", param="tool_choice")
        choice, name = "function", choice.function.name
    return function_tools.resolve(definitions, choice, name, body.parallel_tool_calls)


def chat_prompt(engine: Engine, messages: list[dict], tools: function_tools.Tools, constrained: bool,
                template_kwargs: dict | None = None) -> tuple[str, list[int]]:
    """A chat's prompt as text and token ids, rendered as start_chat renders it (what Anthropic's count_tokens
    counts): with the tools, the client's template variables, and thinking off for a constrained reply."""
    kwargs = reasoning.render_kwargs(engine, template_kwargs or {}, constrained)
    prompt_text = chat_text(engine, messages, True, tools, kwargs)
    return prompt_text, engine.tokenizer.encode(prompt_text, add_special_tokens=False)


def chat_text(engine: Engine, messages: list[ChatMessage] | list[dict], add_generation_prompt: bool = True,
              tools: function_tools.Tools = function_tools.NO_TOOLS, template_kwargs: dict | None = None) -> str:
    """Chat messages rendered through the model's chat template (what /tokenize shows)."""
    with _template_refusals():
        return engine.tokenizer.render_chat(_as_dicts(messages), add_generation_prompt, tools.functions,
                                            template_kwargs)


def _as_dicts(messages: list[ChatMessage] | list[dict]) -> list[dict]:
    return messages if not messages or isinstance(messages[0], dict) else template_messages(messages)


@contextlib.contextmanager
def _template_refusals():
    try:
        yield
    except EngineError:
        raise
    except Exception as exc:  # the template refused these messages (e.g. "roles must alternate") or choked on them
        raise OpenAIError(400, f"The chat template could not render these messages: {exc}", param="messages") from exc


def _choice(sample: Sample, want_logprobs: bool, engine: Engine, tools: function_tools.Tools,
            split: ReplyReasoning | None) -> ChatChoice:
    logprobs = None
    if want_logprobs:
        entries = visible_logprobs(sample.logprobs or [], sample.finish_reason, sample.stop_reason)
        logprobs = {"content": chat_logprobs(entries, engine.tokenizer), "refusal": None}
    content, calls, thought = sample.text, None, None
    if split is not None:
        thought, content = reasoning.split_reply(split, sample.text)
    if tools.parses_calls:  # calls are read from the answer only, never from the reasoning
        reply = function_tools.ReplySplitter()
        reply.feed(content)
        reply.finish()
        content = reply.text or (None if reply.calls else "")
        calls = [_tool_call(call) for call in reply.calls] or None
    return ChatChoice(
        index=sample.index,
        message=ChatMessageOut(content=content, tool_calls=calls, reasoning_content=thought),
        logprobs=logprobs,
        finish_reason=function_tools.finish_reason(sample.finish_reason, bool(calls)),
    )


def _usage(generation: Generation, reasoning_tokens: int) -> dict:
    return {**generation.usage(), "completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}


def _tool_call(call: function_tools.CallOut) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


async def _chunks(generation: Generation, head: dict, body: ChatCompletionRequest, engine: Engine,
                  tools: function_tools.Tools, split: ReplyReasoning | None) -> AsyncIterator[ChatCompletionChunk]:
    """OpenAI's sequence per choice: a role delta, content (or tool-call) deltas, an empty delta with
    finish_reason; then the usage chunk (choices: []) when asked for, with usage null on every other chunk.
    Chunks are the models /openapi.json shows, sent with the fields they were built with (api/sse.py)."""
    base = {**head, "object": "chat.completion.chunk"}
    usage = {"usage": None} if body.include_usage else {}
    replies = {s.index: function_tools.ReplySplitter() for s in generation.samples} if tools.parses_calls else {}
    thoughts = {s.index: split.parser() for s in generation.samples} if split is not None else {}

    def chunk(index: int, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None):
        choice = ChatChunkChoice(index=index, delta=ChatDelta(**delta), logprobs=logprobs, finish_reason=finish_reason)
        return ChatCompletionChunk(**base, choices=[choice], **usage)

    try:
        for sample in generation.samples:
            yield chunk(sample.index, {"role": "assistant", "content": ""})
        async for sample, out in generation.outputs():
            logprobs = None
            if body.logprobs:
                entries = visible_logprobs(out.logprobs or [], out.finish_reason, out.stop_reason)
                if entries:
                    logprobs = {"content": chat_logprobs(entries, engine.tokenizer), "refusal": None}
            is_last = out.finish_reason is not None
            thought, text = reasoning.feed_reply(thoughts.get(sample.index), out.text, is_last)
            delta = {"content": text} if text else {}
            reply = replies.get(sample.index)
            if reply is not None:
                delta = _reply_delta(reply, text, is_last)
            if thought:
                delta = {"reasoning_content": thought, **delta}
            if delta or logprobs:
                yield chunk(sample.index, delta or {"content": ""}, logprobs=logprobs)
            if out.finish_reason is not None:
                has_calls = reply is not None and bool(reply.calls)
                yield chunk(sample.index, {}, function_tools.finish_reason(out.finish_reason, has_calls))
        if body.include_usage:
            thinking = sum(reasoning.reasoning_tokens(split, s.token_ids, thoughts[s.index].has_reasoning)
                           for s in generation.samples) if thoughts else 0
            yield ChatCompletionChunk(**base, choices=[], usage=_usage(generation, thinking))
    finally:
        generation.abort()  # a client gone before the first output never entered outputs()


def _reply_delta(reply: function_tools.ReplySplitter, text: str, is_last: bool) -> dict:
    """A chunk's delta from one engine output: its content, and its tool calls in OpenAI's stream shape (index, id,
    type, name and arguments). A call arrives whole, once its arguments are complete: a stream never announces a call
    that max_tokens then cuts (engine/text/tool_call_parser.py)."""
    content, calls = reply.feed(text)
    if is_last:
        more_content, more_calls = reply.finish()
        content, calls = content + more_content, calls + more_calls
    delta: dict = {"content": content} if content else {}
    if calls:
        delta["tool_calls"] = [{"index": news.index, "id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": news.arguments}} for call, news in calls]
    return delta
