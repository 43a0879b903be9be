"""A thinking model on Anthropic's Messages API: its reasoning in a `thinking` block before the answer (whole and
streamed through the real `anthropic` SDK), thinking on only when the request enables it, and count_tokens counting
the prompt as the request renders it. The model is test_reasoning_api's tiny random Qwen3 with `<think>` tokens; a
template that opens `<think>` in its generation prompt puts the model's own free text inside the reasoning, which
the test compares with what /v1/completions gives for the same prompt tokens (nothing is faked)."""
from __future__ import annotations

import anthropic
import pytest

from conftest import OPENING_TEMPLATE, QWEN3_TEMPLATE
from test_reasoning_api import thinking_client

HELLO = [{"role": "user", "content": "Hello"}]
GREEDY = {"extra_body": {"temperature": 0}}


def _sdk(client) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=str(client.base_url), api_key="none", http_client=client, max_retries=0)


@pytest.fixture(scope="module")
def opening(default_tokenizer):
    engine, client, _ = thinking_client(default_tokenizer, OPENING_TEMPLATE)
    with client:
        yield client
    engine.stop()


def test_reasoning_comes_back_in_a_thinking_block_whole_and_streamed(opening):
    sdk = _sdk(opening)
    prompt = opening.post("/tokenize", json={"messages": HELLO}).json()["tokens"]
    raw = opening.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0}).json()
    reasoning = raw["choices"][0]["text"]
    assert reasoning and "</think>" not in reasoning
    thinking = {"type": "enabled", "budget_tokens": 1024}
    message = sdk.messages.create(model="", max_tokens=5, messages=HELLO, thinking=thinking, **GREEDY)
    assert [block.type for block in message.content] == ["thinking"]
    assert message.content[0].thinking == reasoning and message.stop_reason == "max_tokens"
    with sdk.messages.stream(model="", max_tokens=5, messages=HELLO, thinking=thinking, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == reasoning
    deltas = [e.delta.thinking for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]
    assert "".join(deltas) == reasoning


def test_thinking_is_on_only_when_the_request_enables_it_and_count_tokens_renders_as_the_request(default_tokenizer):
    engine, client, _ = thinking_client(default_tokenizer, QWEN3_TEMPLATE)
    try:
        with client:
            sdk = _sdk(client)
            counts = {}
            for name, thinking in [("absent", None), ("disabled", {"type": "disabled"}),
                                   ("enabled", {"type": "enabled", "budget_tokens": 1024})]:
                extra = {} if thinking is None else {"thinking": thinking}
                counts[name] = sdk.messages.count_tokens(model="", messages=HELLO, **extra).input_tokens
                message = sdk.messages.create(model="", max_tokens=2, messages=HELLO, **extra, **GREEDY)
                assert message.usage.input_tokens + message.usage.cache_read_input_tokens == counts[name]
            # Qwen3's template turns thinking off by closing an empty <think></think> block in the prompt.
            closed = client.post("/tokenize", json={"prompt": "<think>\n\n</think>\n\n", "add_special_tokens": False})
            assert counts["absent"] == counts["disabled"] == counts["enabled"] + len(closed.json()["tokens"])
    finally:
        engine.stop()
