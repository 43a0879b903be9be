"""The Responses API's output: a reply's text and calls as output items (a `reasoning` item with a thinking model's
`reasoning_text`, then a `message` with `output_text`, or `function_call`s), the events that announce them in a stream, and the response object around them.

One OutputBuilder serves both a stream and a whole answer: fed the same reply, it builds the same items, so the
object after `response.completed` equals what a non-streamed request returns (ids aside).
"""
from __future__ import annotations

import time
import uuid

from api import function_tools

# OpenAI's `incomplete_details.reason` when max_output_tokens cut the reply.
MAX_OUTPUT_TOKENS = "max_output_tokens"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """Items of one response, built from its reply as the reply streams. add() and finish() return the events (dicts
    without sequence_number: the stream numbers them) for what changed."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._open: dict | None = None  # the item still growing: a message, or a call waiting for its arguments
        self._calls: dict[str, dict] = {}  # call id -> its item

    def add(self, content: str, calls: list[tuple[function_tools.CallOut, function_tools.CallDelta]]) -> list[dict]:
        events: list[dict] = []
        if content:
            if self._open is None or self._open["type"] != "message":
                events += self._close("completed") + self._open_message()
            events.append(self._text_event("response.output_text.delta", delta=content))
            self._open["content"][0]["text"] += content
        for call, delta in calls:
            events += self._close("completed") + self._open_call(call)  # a call arrives whole (tool_call_parser.py)
            item = self._calls[call.id]
            if delta.arguments:
                item["arguments"] += delta.arguments
                events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                               "output_index": self._index(item), "delta": delta.arguments})
        return events

    def add_reasoning(self, text: str) -> list[dict]:
        """A piece of a thinking model's reasoning: it grows one `reasoning` item, which comes before the answer."""
        if not text:
            return []
        events: list[dict] = []
        if self._open is None or self._open["type"] != "reasoning":
            events += self._close("completed") + self._open_reasoning()
        item = self._open
        item["content"][0]["text"] += text
        events.append({"type": "response.reasoning_text.delta", "item_id": item["id"], "output_index": self._index(item),
                       "content_index": 0, "delta": text})
        return events

    def finish(self, status: str) -> list[dict]:
        """The reply ended ("completed", or "incomplete" when cut): close the last item. A reply with neither text
        nor calls still answers with a message, empty."""
        events = [] if self.items else self._open_message()
        return events + self._close(status)

    def _open_message(self) -> list[dict]:
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": [part]}
        self.items.append(item)
        self._open = item
        added = {**item, "content": []}
        return [
            {"type": "response.output_item.added", "output_index": self._index(item), "item": added},
            {"type": "response.content_part.added", "item_id": item["id"], "output_index": self._index(item),
             "content_index": 0, "part": dict(part)},
        ]

    def _open_reasoning(self) -> list[dict]:
        item = {"id": new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}]}
        self.items.append(item)
        self._open = item
        return [{"type": "response.output_item.added", "output_index": self._index(item), "item": {**item, "content": []}}]

    def _open_call(self, call: function_tools.CallOut) -> list[dict]:
        item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call.id,
                "name": call.name, "arguments": ""}
        self.items.append(item)
        self._calls[call.id] = item
        self._open = item
        return [{"type": "response.output_item.added", "output_index": self._index(item), "item": dict(item)}]

    def _close(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        index = self._index(item)
        if item["type"] == "function_call":
            done = {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
                    "name": item["name"], "arguments": item["arguments"]}
            return [done, {"type": "response.output_item.done", "output_index": index, "item": dict(item)}]
        if item["type"] == "reasoning":
            part = item["content"][0]
            done = {"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": index,
                    "content_index": 0, "text": part["text"]}
            return [done, {"type": "response.output_item.done", "output_index": index,
                           "item": {**item, "content": [dict(part)]}}]
        self._open = item  # for _text_event
        part = item["content"][0]
        events = [
            self._text_event("response.output_text.done", text=part["text"]),
            {"type": "response.content_part.done", "item_id": item["id"], "output_index": index, "content_index": 0,
             "part": dict(part)},
            {"type": "response.output_item.done", "output_index": index, "item": {**item, "content": [dict(part)]}},
        ]
        self._open = None
        return events

    def _text_event(self, kind: str, **fields) -> dict:
        item = self._open
        return {"type": kind, "item_id": item["id"], "output_index": self._index(item), "content_index": 0,
                **fields, "logprobs": []}

    def _index(self, item: dict) -> int:
        return next(i for i, other in enumerate(self.items) if other is item)


def response_object(response_id: str, created_at: int, request, status: str, output: list[dict],
                    usage: dict | None, model: str, tools: list[dict], error: dict | None = None) -> dict:
    """The response in OpenAI's shape, echoing the request's settings as OpenAI does."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": error,
        "incomplete_details": {"reason": MAX_OUTPUT_TOKENS} if status == "incomplete" else None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "store": request.store is not False,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "text": {"format": (request.text or {}).get("format") or {"type": "text"}},
        "tool_choice": request.tool_choice or ("auto" if request.tools else "none"),
        "tools": tools,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": request.user,
        "metadata": request.metadata or {},
    }


def usage(num_input_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0,
          num_reasoning_tokens: int = 0) -> dict:
    return {
        "input_tokens": num_input_tokens,
        "input_tokens_details": {"cached_tokens": num_cached_tokens},
        "output_tokens": num_output_tokens,
        "output_tokens_details": {"reasoning_tokens": num_reasoning_tokens},
        "total_tokens": num_input_tokens + num_output_tokens,
    }
