"""A reply that ends inside a character (max_tokens or an end-of-sequence token cuts an emoji's bytes), on a tiny
random model forced by logit_bias: the unfinished character is left out, streamed or not, on chat and completions,
while its token still counts in usage and shows in logprobs."""
from __future__ import annotations

import pytest

from conftest import sse_chunks

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Reply with an emoji."}]
PROMPT = "Reply with an emoji:"


@pytest.fixture
def cut(tiny_api) -> tuple[int, bytes]:
    """The first token of " 😀": a space, then three of the emoji's four bytes."""
    engine, _ = tiny_api
    token_id = engine.tokenizer.encode(" 😀", add_special_tokens=False)[0]
    assert engine.tokenizer.token_bytes(token_id) == " 😀".encode()[:4]
    return token_id, engine.tokenizer.token_bytes(token_id)


def endings(tiny_api, token_id: int) -> dict[str, tuple[dict, str, int]]:
    """Ways to end right after the cut token: (request fields, finish_reason, tokens per choice)."""
    engine, _ = tiny_api
    eos = min(engine.tokenizer.eos_ids)
    # The penalties take 4 off the cut token once it is out, so the end-of-sequence token, 2 behind, comes next.
    after_eos = {"max_tokens": 5, "logit_bias": {str(token_id): 100, str(eos): 98},
                 "presence_penalty": 2, "frequency_penalty": 2}
    return {"length": ({"max_tokens": 1, "logit_bias": {str(token_id): 100}}, "length", 1), "eos": (after_eos, "stop", 2)}


@pytest.mark.parametrize("ending", ["length", "eos"])
def test_chat_leaves_the_unfinished_character_out_streamed_or_not(tiny_api, cut, ending):
    _, client = tiny_api
    token_id, token_bytes = cut
    fields, finish_reason, num_tokens = endings(tiny_api, token_id)[ending]
    body = {"messages": MESSAGES, "temperature": 0, "n": 2, "logprobs": True, **fields}
    whole = client.post(CHAT, json=body).json()
    chunks = sse_chunks(client.post(CHAT, json={**body, "stream": True, "stream_options": {"include_usage": True}}))

    assert whole["usage"]["completion_tokens"] == 2 * num_tokens  # the cut token counts
    assert _counts(chunks[-1]["usage"]) == _counts(whole["usage"])
    for choice in whole["choices"]:
        assert choice["message"]["content"] == " "  # the space before the emoji is whole and stays
        assert choice["finish_reason"] == finish_reason
        [entry] = choice["logprobs"]["content"]  # the end-of-sequence token is not shown, the cut one is
        assert bytes(entry["bytes"]) == token_bytes
        deltas = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == choice["index"]]
        assert "".join(d["delta"].get("content") or "" for d in deltas) == " "
        assert [d["finish_reason"] for d in deltas if d["finish_reason"]] == [finish_reason]
        streamed = [e for d in deltas if d.get("logprobs") for e in d["logprobs"]["content"]]
        assert [bytes(e["bytes"]) for e in streamed] == [token_bytes]


@pytest.mark.parametrize("ending", ["length", "eos"])
def test_completions_leave_the_unfinished_character_out_streamed_or_not(tiny_api, cut, ending):
    engine, client = tiny_api
    token_id, _ = cut
    fields, finish_reason, num_tokens = endings(tiny_api, token_id)[ending]
    body = {"prompt": [PROMPT, PROMPT + " ok"], "temperature": 0, "n": 2, "logprobs": 1, **fields}
    whole = client.post(COMPLETIONS, json=body).json()
    chunks = sse_chunks(client.post(COMPLETIONS, json={**body, "stream": True, "stream_options": {"include_usage": True}}))

    assert whole["usage"]["completion_tokens"] == 4 * num_tokens
    assert _counts(chunks[-1]["usage"]) == _counts(whole["usage"])
    assert len(whole["choices"]) == 4
    for choice in whole["choices"]:
        prompt = body["prompt"][choice["index"] // 2]
        assert (choice["text"], choice["finish_reason"]) == (" ", finish_reason)
        logprobs = choice["logprobs"]  # every generated token is listed, the end-of-sequence token too
        assert logprobs["tokens"][0] == engine.tokenizer.token_text(token_id) and len(logprobs["tokens"]) == num_tokens
        assert logprobs["text_offset"][0] == len(prompt)
        parts = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == choice["index"]]
        assert "".join(p["text"] for p in parts) == " "
        assert [p["finish_reason"] for p in parts if p["finish_reason"]] == [finish_reason]
        assert [t for p in parts for t in p["logprobs"]["tokens"]] == logprobs["tokens"]


def _counts(usage: dict) -> tuple[int, int, int]:
    """The token counts; cached_tokens differs between two requests of one prompt (the second finds it cached)."""
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]
