"""ResponseStore: stored responses of the Responses API, in memory, bounded: the least recently used is dropped.

A response is stored when its request says `store` (true by default, as OpenAI). What is kept is what a later
request needs: the response object (GET /v1/responses/{id}) and the conversation it ended (its history, input and
output as chat messages), which `previous_response_id` continues. Nothing survives a restart.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_MAX_STORED_RESPONSES = 1024


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object as the client received it
    messages: tuple[dict, ...]  # the conversation up to and including this response's output, instructions left out


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        self.max_responses = max_responses
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, stored: StoredResponse) -> None:
        with self._lock:
            self._responses[stored.response["id"]] = stored
            self._responses.move_to_end(stored.response["id"])
            while len(self._responses) > self.max_responses:
                self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None: never stored, deleted or dropped."""
        with self._lock:
            stored = self._responses.get(response_id)
            if stored is not None:
                self._responses.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._responses.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._responses)
