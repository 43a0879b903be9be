"""ForwardedRequest: one HTTP request as the ingress hands it to a replica (whole, with what the router needs to
place it), and PrefixKeys: a prompt -> the hashes of its full KV blocks, computed as the engine's scheduler does."""
from __future__ import annotations

import json
from dataclasses import dataclass

from engine.kv_cache import block_hash
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
        return self.hashes(prompt_ids) if prompt_ids else ()

    def hashes(self, prompt_ids: list[int]) -> tuple[bytes, ...]:
        """As engine/scheduler.py: the blocks wholly before the last token, each hash chained to the one before."""
        hashes, parent = [], b""
        for index in range((len(prompt_ids) - 1) // self.block_size):
            parent = block_hash(parent, prompt_ids[index * self.block_size : (index + 1) * self.block_size])
            hashes.append(parent)
        return tuple(hashes)

    def _prompt_ids(self, path: str, payload: dict) -> list[int] | None:
        if path in _CHAT_PATHS:
            messages = payload.get("messages")
            if payload.get("tools") or not isinstance(messages, list):
                return None  # tools change the system prompt in ways only the API's code knows
            return self.tokenizer.chat_prompt_ids([_template_message(m) for m in messages])
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: its first prompt decides
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        return None


def _template_message(message: dict) -> dict:
    """As api/protocol.py template_messages renders a plain message: `developer` is a system prompt, text parts
    joined by newlines."""
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(part["text"] for part in content)
    entry = {"role": "system" if message["role"] == "developer" else message["role"], "content": content or ""}
    if message.get("name"):
        entry["name"] = message["name"]
    return entry
