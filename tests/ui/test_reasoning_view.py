"""The Chat tab with a thinking model: the reasoning streams into a folded "Reasoning" message above the answer, and is
sent back to the template as reasoning_content. A tiny random Qwen3 (conftest.thinking_engine) under a template that
opens <think> in its generation prompt, so the model's own words are reasoning: the tests compare them with the
engine's own greedy answer to the same prompt tokens."""
from __future__ import annotations

import asyncio

import pytest

from conftest import OPENING_TEMPLATE, QWEN3_TEMPLATE, thinking_engine
from engine import SamplingParams
from engine.registry import ModelRegistry
from ui.chat import REASONING_TITLE, ChatSession, build_messages, generate_reply, render_chatbot

GREEDY = dict(system_prompt="", temperature=0.0, top_p=1.0, top_k=0, max_tokens=6, seed="", stop="", schema_text="")


def replies(models: ModelRegistry, history: list[dict]) -> list[tuple]:
    async def run():
        return [out async for out in generate_reply(models, history, session=ChatSession(), **GREEDY)]

    return asyncio.run(run())


@pytest.fixture
def opening_handle(default_tokenizer):
    engine, _ = thinking_engine(default_tokenizer, OPENING_TEMPLATE)
    yield ModelRegistry.serving(engine)
    engine.stop()


def test_the_reasoning_streams_folded_above_the_answer(opening_handle):
    engine = opening_handle.handle().engine
    history = [{"role": "user", "content": "Hello", "tokens": None}]
    prompt_ids = engine.tokenizer.chat_prompt_ids(build_messages(history, ""))
    raw = engine.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=6))[0].choices[0].text
    updates = replies(opening_handle, history)
    streaming_chatbot, _, _ = updates[0]
    assert streaming_chatbot[-1]["metadata"] == {"title": REASONING_TITLE, "status": "pending"}
    chatbot, final_history, _ = updates[-1]
    thought = chatbot[1]
    assert thought["metadata"] == {"title": REASONING_TITLE, "status": "done"}
    assert thought["content"] == raw != ""  # never closed: all of it is reasoning, and no empty answer bubble
    assert len(chatbot) == 2
    assert final_history[-1]["reasoning"] == raw and final_history[-1]["content"] == ""


def test_a_reasoned_turn_shows_reasoning_then_answer_and_goes_back_as_reasoning_content():
    history = [{"role": "user", "content": "Hi", "tokens": None},
               {"role": "assistant", "content": "Hello!", "reasoning": "Greet back.", "tokens": []}]
    chatbot = render_chatbot(history, show_probs=False)
    assert chatbot[1] == {"role": "assistant", "content": "Greet back.",
                          "metadata": {"title": REASONING_TITLE, "status": "done"}}
    assert chatbot[2] == {"role": "assistant", "content": "Hello!"}
    assert build_messages(history, "")[1] == {"role": "assistant", "content": "Hello!",
                                              "reasoning_content": "Greet back."}


def test_a_model_that_does_not_think_shows_no_reasoning(default_tokenizer):
    engine, think_id = thinking_engine(default_tokenizer, QWEN3_TEMPLATE)
    try:
        hello = [{"role": "user", "content": "Hello", "tokens": None}]
        chatbot, history, _ = replies(ModelRegistry.serving(engine), hello)[-1]
        # Qwen3's template leaves the choice to the model; this random one never opens <think>.
        assert all("metadata" not in message for message in chatbot)
        assert history[-1]["content"] != "" and history[-1]["reasoning"] == ""
    finally:
        engine.stop()
