"""Thinking models on the API: reasoning_content on chat (whole and streamed), a `reasoning` item on the Responses API,
chat_template_kwargs (enable_thinking: false), reasoning sent back as history, and grammars kept to the answer.

The model is a tiny random Qwen3 with the default model's tokenizer, given Qwen3's `<think>`/`</think>` as added
(non-special) tokens and the real Qwen3 chat template (tests/fixtures/). A random model never writes `<think>` by
itself, so the tests make it, honestly and through the public API only: `logit_bias` of +100 on the `<think>` token
makes the real engine sample it at every step (so the reply opens a block and never closes it); a template that opens
`<think>` in its generation prompt (DeepSeek-R1's shape) puts the model's own free text inside the reasoning, which
the tests compare with what /v1/completions gives for the same prompt tokens. The clients are the real openai SDK
and raw HTTP, over the real routes in process (an httpx TestClient)."""
from __future__ import annotations

import json

import pytest
from openai import OpenAI

from conftest import OPENING_TEMPLATE, QWEN3_TEMPLATE, api_app, sse_chunks, thinking_engine

HELLO = [{"role": "user", "content": "Hello"}]


def thinking_client(default_tokenizer, template: str):
    """(engine, TestClient, `<think>` token id) for a tiny random Qwen3 whose tokenizer has the think tokens."""
    from fastapi.testclient import TestClient

    engine, think_id = thinking_engine(default_tokenizer, template)
    return engine, TestClient(api_app(engine)), think_id


@pytest.fixture(scope="module")
def qwen3(default_tokenizer):
    engine, client, think_id = thinking_client(default_tokenizer, QWEN3_TEMPLATE)
    with client:
        yield client, think_id
    engine.stop()


@pytest.fixture(scope="module")
def sdk(qwen3) -> OpenAI:
    client, _ = qwen3
    return OpenAI(base_url=f"{client.base_url}/v1", api_key="none", http_client=client, max_retries=0)


def forced_think(think_id: int, max_tokens: int = 4) -> dict:
    return {"temperature": 0, "max_tokens": max_tokens, "logit_bias": {str(think_id): 100}}


def test_the_engine_knows_the_model_thinks_and_that_its_template_can_turn_it_off(qwen3):
    client, _ = qwen3
    info = client.post("/tokenize", json={"messages": HELLO, "chat_template_kwargs": {"enable_thinking": False}})
    plain = client.post("/tokenize", json={"messages": HELLO})
    off, on = info.json()["tokens"], plain.json()["tokens"]
    detok = client.post("/detokenize", json={"tokens": off[len(on):]}).json()["prompt"]
    assert off[:len(on)] == on and detok == "<think>\n\n</think>\n\n"  # Qwen3's template closes an empty block


def test_a_reply_that_opens_think_lands_in_reasoning_content_and_unclosed_is_all_reasoning(qwen3, sdk):
    _, think_id = qwen3
    completion = sdk.chat.completions.create(model="", messages=HELLO, **forced_think(think_id))
    choice = completion.choices[0]
    # The first <think> opens the block; the next three are its text; it never closes before max_tokens.
    assert choice.message.reasoning_content == "<think>" * 3
    assert choice.message.content == ""
    assert choice.finish_reason == "length"
    # All four tokens were reasoning (the opening tag included), as usage says of a thinking reply.
    assert completion.usage.completion_tokens_details.reasoning_tokens == completion.usage.completion_tokens == 4


def test_streamed_reasoning_arrives_as_reasoning_content_deltas_and_matches_the_whole_answer(qwen3):
    client, think_id = qwen3
    body = {"messages": HELLO, "stream": True, "stream_options": {"include_usage": True}, **forced_think(think_id, 6)}
    *chunks, usage = sse_chunks(client.post("/v1/chat/completions", json=body))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "<think>" * 5
    assert "".join(d.get("content") or "" for d in deltas) == ""
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["usage"]["completion_tokens_details"] == {"reasoning_tokens": 6}


def test_enable_thinking_false_leaves_no_reasoning_content(qwen3, sdk):
    _, think_id = qwen3
    completion = sdk.chat.completions.create(model="", messages=HELLO, **forced_think(think_id),
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = completion.choices[0].message
    # The template closed the block in the prompt, so whatever the model writes is the answer.
    assert message.reasoning_content is None
    assert message.content == "<think>" * 4
    assert completion.usage.completion_tokens_details.reasoning_tokens == 0


def test_a_template_that_opens_think_puts_the_model_s_own_words_in_reasoning(default_tokenizer):
    engine, client, _ = thinking_client(default_tokenizer, OPENING_TEMPLATE)
    try:
        with client:
            prompt = client.post("/tokenize", json={"messages": HELLO}).json()["tokens"]
            raw = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0}).json()
            chat = client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 5, "temperature": 0})
            message = chat.json()["choices"][0]["message"]
            assert "</think>" not in raw["choices"][0]["text"]
            assert message["reasoning_content"] == raw["choices"][0]["text"] != ""
            assert message["content"] == ""
            assert chat.json()["choices"][0]["finish_reason"] == "length"
    finally:
        engine.stop()


def test_reasoning_sent_back_as_history_reaches_the_template_which_keeps_only_the_latest(qwen3):
    client, _ = qwen3
    turn = {"role": "assistant", "content": "Hi there.", "reasoning_content": "They said hello."}

    def rendered(messages):
        tokens = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
        return client.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]

    assert "<think>\nThey said hello.\n</think>\n\nHi there." in rendered([*HELLO, turn])
    later = rendered([*HELLO, turn, {"role": "user", "content": "Bye"}])
    assert "They said hello." not in later and "Hi there." in later
    reply = client.post("/v1/chat/completions", json={"messages": [*HELLO, turn, HELLO[0]], "max_tokens": 2})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("kwargs,param", [
    ("enable_thinking", "chat_template_kwargs"),
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
    ({"messages": []}, "chat_template_kwargs.messages"),
    ({"return_dict": True}, "chat_template_kwargs.return_dict"),  # would change what the renderer returns
])
def test_bad_chat_template_kwargs_are_a_400_and_the_server_keeps_answering(qwen3, kwargs, param):
    client, _ = qwen3
    bad = client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 1, "chat_template_kwargs": kwargs})
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == param
    assert client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 1}).status_code == 200


def test_a_reply_held_to_a_schema_has_thinking_turned_off_and_is_all_answer(qwen3, sdk):
    client, think_id = qwen3
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    completion = sdk.chat.completions.create(
        model="", messages=HELLO, temperature=0, max_tokens=20,
        response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}})
    message = completion.choices[0].message
    assert message.reasoning_content is None
    assert isinstance(json.loads(message.content)["ok"], bool)
    off = client.post("/tokenize", json={"messages": HELLO, "chat_template_kwargs": {"enable_thinking": False}})
    assert completion.usage.prompt_tokens == off.json()["count"]  # rendered with enable_thinking: false


def test_the_responses_api_takes_chat_template_kwargs(qwen3, sdk):
    client, _ = qwen3
    response = sdk.responses.create(model="", input="Hello", max_output_tokens=2,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    off = client.post("/tokenize", json={"messages": HELLO, "chat_template_kwargs": {"enable_thinking": False}})
    on = client.post("/tokenize", json={"messages": HELLO})
    assert response.usage.input_tokens == off.json()["count"] != on.json()["count"]


def test_responses_reasoning_item_whole_and_streamed(default_tokenizer):
    engine, client, _ = thinking_client(default_tokenizer, OPENING_TEMPLATE)
    try:
        with client:
            sdk = OpenAI(base_url=f"{client.base_url}/v1", api_key="none", http_client=client, max_retries=0)
            response = sdk.responses.create(model="", input="Hello", max_output_tokens=5, temperature=0)
            assert response.status == "incomplete"
            item = response.output[0]
            assert item.type == "reasoning" and item.id.startswith("rs_") and item.summary == []
            assert item.content[0].type == "reasoning_text" and item.content[0].text != ""
            assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens == 5
            # The conversation goes on from it: stored, or sent back as input items (reasoning included).
            assert sdk.responses.create(model="", previous_response_id=response.id, input="Bye",
                                        max_output_tokens=1).status == "incomplete"
            history = [{"role": "user", "content": "Hello"}, item.model_dump(exclude_none=True),
                       {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Bye"}]
            assert sdk.responses.create(model="", input=history, max_output_tokens=1).status == "incomplete"
            body = {"input": "Hello", "max_output_tokens": 5, "temperature": 0, "stream": True}
            streamed = client.post("/v1/responses", json=body)
            events = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines()
                      if line.startswith("data: ")]
            kinds = [e["type"] for e in events]
            deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
            done = [e["text"] for e in events if e["type"] == "response.reasoning_text.done"]
            assert kinds.index("response.output_item.added") < kinds.index("response.reasoning_text.delta")
            assert deltas == done[0] == item.content[0].text
            assert events[-1]["type"] == "response.incomplete"
            assert events[-1]["response"]["output"][0]["content"][0]["text"] == item.content[0].text
    finally:
        engine.stop()
