"""ForwardedRequest: one HTTP request as the ingress hands it to a replica (whole, with what the router needs to
place it), and PrefixKeys: a prompt -> the hashes of its full KV blocks, by the scheduler's own function, its chat
messages rendered by the API's own template_messages."""
from __future__ import annotations

import json
from dataclasses import dataclass

from api.protocol import ChatMessage, template_messages
from engine.kv_cache import prefix_block_hashes
from engine.text.tokens import TokenizerView

REPLICA_HEADER = "x-tern-replica"  # every answer names the replica that gave it
REPLICA_COOKIE = "tern-replica"  # a browser's UI session stays on one replica (Gradio keeps its sessions in memory)
# Where a prompt is read from for routing. Other routes (the UI, /v1/responses, tokenizer routes) go by load.
_CHAT_PATHS = frozenset({"/v1/chat/completions"})
_COMPLETION_PATHS = frozenset({"/v1/completions"})


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request, read whole by the ingress. The replica replays it into its own Tern app."""

    scope: dict  # the ASGI scope's plain parts (method, path, query_string, headers, client, ...)
    body: bytes
    prefix_hashes: tuple[bytes, ...] = ()  # the prompt's full KV blocks, chained as the engine hashes them
    replica_id: str | None = None  # the replica this browser is pinned to (REPLICA_COOKIE), if any


class PrefixKeys:
    """Prompt -> block hashes, for chat and completions requests. The ingress tokenizes as the replica's API will
    (same tokenizer, same chat template, same block size); where it cannot tell (tools, a body it cannot read) the
    request has no key and goes by load. A key that is wrong costs affinity, never an answer: the replica computes
    the real prompt itself."""

    def __init__(self, tokenizer: TokenizerView, block_size: int) -> None:
        self.tokenizer, self.block_size = tokenizer, block_size

    def of(self, path: str, body: bytes) -> tuple[bytes, ...]:
        if path not in _CHAT_PATHS and path not in _COMPLETION_PATHS:
            return ()
        try:
            payload = json.loads(body)
            prompt_ids = self._prompt_ids(path, payload)
        except Exception:  # a malformed body is the replica's to refuse (a 400 in OpenAI's shape)
            return ()
        return tuple(prefix_block_hashes(prompt_ids, self.block_size)) if prompt_ids else ()

    def _prompt_ids(self, path: str, payload: dict) -> list[int] | None:
        if path in _CHAT_PATHS:
            messages = payload.get("messages")
            if payload.get("tools") or not isinstance(messages, list):
                return None  # tools change the system prompt in ways only the API's code knows
            return self.tokenizer.chat_prompt_ids(template_messages([ChatMessage.model_validate(m) for m in messages]))
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: its first prompt decides
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        return None

