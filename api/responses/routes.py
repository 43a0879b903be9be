"""The Responses API: POST /v1/responses (one JSON body, or a stream of typed events), GET and DELETE
/v1/responses/{id}. A response is a chat turn: its input and instructions (and the stored conversation of
previous_response_id) become chat messages, and it runs on chat's path (api/chat.py start_chat), so sampling,
grammars, tools, cancellation on disconnect, 429 and the API key behave as they do there."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine import FINISH_ABORT
from engine.text.reasoning import count_reasoning_tokens

from api import function_tools
from api.bodies import ERRORS
from api.chat import start_chat
from api.errors import OpenAIError, to_openai_error
from api.generation import Generation, until_disconnected
from api.reasoning import ReplyReasoning, checked_template_kwargs, feed_reply
from api.responses.bodies import DeletedResponse, ResponseObject, streamed_events
from api.responses.input import (
    ResponsesRequest, input_messages, output_messages, response_tools, text_format,
)
from api.responses.output import OutputBuilder, new_id, response_object, usage
from api.responses.store import ResponseStore, StoredResponse
from api.route_context import RouteContext
from api.sse import HEADERS


def add_routes(router: APIRouter, context: RouteContext, store: ResponseStore) -> None:
    @router.post("/v1/responses", response_model=ResponseObject, responses=streamed_events(),
                 summary="Create a response")
    async def create_response(body: ResponsesRequest, request: Request):
        served = await context.serve(body.model)
        engine = served.engine
        params = body.to_sampling_params()
        history: list[dict] = []
        if body.previous_response_id is not None:
            history = list(_stored(store, body.previous_response_id, "previous_response_id").messages)
        new_input = input_messages(body.input)
        tools = response_tools(body)
        instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
        response_id = new_id("resp")
        template_kwargs = checked_template_kwargs(engine, body.chat_template_kwargs)
        generation, split = await start_chat(served, instructions + history + new_input, params, tools,
                                             text_format(body.text), response_id, request, template_kwargs)
        run = _Run(body, generation, history + new_input, served.model_id, store, tools.parses_calls, split)
        if body.stream:
            return StreamingResponse(_framed(run.events()), media_type="text/event-stream", headers=HEADERS)
        await until_disconnected(request, generation.collect())
        return JSONResponse(run.finish_whole())

    @router.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=ERRORS,
                summary="Get a stored response")
    async def get_response(response_id: str):
        return JSONResponse(_stored(store, response_id, "response_id").response)

    @router.delete("/v1/responses/{response_id}", response_model=DeletedResponse, responses=ERRORS,
                   summary="Delete a stored response")
    async def delete_response(response_id: str):
        if not store.delete(response_id):
            raise _not_found(response_id, "response_id")
        return {"id": response_id, "object": "response", "deleted": True}


class _Run:
    """One response being generated: its output builder over the one sample's reply, and the object around it."""

    def __init__(self, body: ResponsesRequest, generation: Generation, conversation: list[dict], model: str,
                 store: ResponseStore, parses_calls: bool, split: ReplyReasoning | None) -> None:
        self.body, self.generation, self.conversation, self.store = body, generation, conversation, store
        self.response_id = generation.response_id
        self.created_at = int(time.time())
        self.model = model
        self.reply = function_tools.ReplySplitter()
        self.parses_calls = parses_calls
        self.thought = split.parser() if split is not None else None  # reasoning first, then the answer
        self.output = OutputBuilder()
        self.tools = [_tool_echo(t) for t in body.tools or []]

    def response(self, status: str, error: dict | None = None) -> dict:
        sample = self.generation.samples[0]
        thinking = count_reasoning_tokens(sample.token_ids, self.thought.tags, self.thought.has_reasoning) \
            if self.thought is not None else 0
        counts = (usage(self.generation.num_prompt_tokens, len(sample.token_ids), self.generation.num_cached_tokens,
                        thinking) if status != "in_progress" else None)
        return response_object(self.response_id, self.created_at, self.body, status, self.output.items, counts,
                               self.model, self.tools, error)

    def feed(self, text: str, is_last: bool = False) -> list[dict]:
        thought, text = feed_reply(self.thought, text, is_last)
        events = self.output.add_reasoning(thought)
        if not self.parses_calls:
            return events + self.output.add(text, [])
        return events + self.output.add(*self.reply.feed(text))

    def end(self, finish_reason: str | None) -> tuple[list[dict], dict]:
        """The reply ended: its last events, and the finished response (stored, when the request says store)."""
        events = self.feed("", is_last=True)
        events += self.output.add(*self.reply.finish()) if self.parses_calls else []
        status = "incomplete" if finish_reason == "length" else "completed"
        events += self.output.finish(status)
        response = self.response(status)
        if self.body.store is not False:
            messages = tuple(self.conversation + output_messages(response["output"]))
            self.store.put(StoredResponse(response, messages))
        return events, response

    def finish_whole(self) -> dict:
        sample = self.generation.samples[0]
        self.feed(sample.text)
        return self.end(sample.finish_reason)[1]

    async def events(self) -> AsyncIterator[dict]:
        """OpenAI's event sequence: created, in_progress, the items' events, then completed (or incomplete)."""
        yield {"type": "response.created", "response": self.response("in_progress")}
        yield {"type": "response.in_progress", "response": self.response("in_progress")}
        try:
            async for _, out in self.generation.outputs():
                for event in self.feed(out.text):
                    yield event
                if out.finish_reason == FINISH_ABORT:
                    error = {"code": "server_error", "message": "the server shut down before this response finished"}
                    yield {"type": "response.failed", "response": self.response("failed", error)}
                    return
                if out.finish_reason is not None:
                    events, response = self.end(out.finish_reason)
                    for event in events:
                        yield event
                    yield {"type": f"response.{response['status']}", "response": response}
        except Exception as exc:  # a failed step: the stream says so in its own terms, then ends
            error = to_openai_error(exc)
            yield {"type": "response.failed",
                   "response": self.response("failed", {"code": "server_error", "message": error.message})}
        finally:
            self.generation.abort()


async def _framed(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Each event as OpenAI frames them, `event: <type>` then `data: <json>`, numbered from 0; no [DONE]."""
    number = 0
    async for event in events:
        event = {**event, "sequence_number": number}
        number += 1
        data = json.dumps(event, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        yield f"event: {event['type']}\ndata: {data}\n\n"


def _tool_echo(tool: dict) -> dict:
    """A function tool as the response object lists it (OpenAI fills in what the request left out)."""
    return {"type": "function", "name": tool.get("name"), "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": tool.get("strict", True)}


def _stored(store: ResponseStore, response_id: str, param: str) -> StoredResponse:
    stored = store.get(response_id)
    if stored is None:
        raise _not_found(response_id, param)
    return stored


def _not_found(response_id: str, param: str) -> OpenAIError:
    message = f"No response found with id '{response_id}' (never stored, deleted, or dropped from this server's store)."
    return OpenAIError(404, message, param=param, code="response_not_found")
