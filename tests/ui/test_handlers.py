"""The UI's event handlers called directly, over the real default model (or tiny engines): the wiring of every
control, Stop/Retry/Clear, a JSON schema for the reply, errors shown as messages, the Score, Complete and Server
tabs."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import gradio as gr
import jsonschema
import pytest

from conftest import registry_over
from engine import SamplingParams
from engine.registry import ModelRegistry
from ui.chat import (
    ChatSession, add_user_message, build_messages, clear_chat, drop_last_reply, generate_reply, render_chatbot,
    show_token_view,
)
from ui.complete import complete_text
from ui.scoring import score_continuations
from ui.server import describe_model, live_stats, model_facts, openai_snippet

pytestmark = pytest.mark.slow

GREEDY = dict(system_prompt="", session=ChatSession(), temperature=0.0, top_p=1.0, top_k=0, max_tokens=24, seed="",
              stop="", schema_text="")
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}},
    "required": ["city", "country"],
    "additionalProperties": False,
}
# Bounded everywhere, so that a random model cannot write forever inside it.
ANIMAL = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["bird", "fish", "mammal"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 99},
        "name": {"type": "string", "minLength": 2, "maxLength": 8},
    },
    "required": ["kind", "count", "name"],
    "additionalProperties": False,
}
VALID_MARK = "\u2713 Valid JSON"


@pytest.fixture(scope="module")
def registry(default_engine) -> ModelRegistry:
    """The default model as a one-model server serves it (the engine stays the session's)."""
    return ModelRegistry.serving(default_engine)


def engine_of(registry: ModelRegistry):
    return registry.handle().engine


def tiny_served(engine) -> ModelRegistry:
    return ModelRegistry.serving(engine)


def collect(agen) -> list:
    async def run():
        return [out async for out in agen]

    return asyncio.run(run())


def chat(registry, history: list[dict], **overrides) -> tuple[list[dict], list[dict], str]:
    """Run generate_reply to the end; -> its last (chatbot, history, notice)."""
    args = {**GREEDY, **overrides}
    return collect(generate_reply(registry, history, *args.values()))[-1]


def ask(registry, message: str, history: list[dict] | None = None, **overrides) -> tuple[list[dict], list[dict], str]:
    _, history, _, _ = add_user_message(message, history or [], False)
    return chat(registry, history, **overrides)


def score(registry, prompt: str, continuations: str, second_model: str | None = None) -> tuple[dict, str, str]:
    """Run score_continuations to the end; -> its last (table, per-token HTML, notice)."""
    return collect(score_continuations(registry, prompt, continuations, None, second_model))[-1]


def reply_of(history: list[dict]) -> str:
    assert history[-1]["role"] == "assistant"
    return history[-1]["content"]


def wait_until_idle(engine, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_kv_blocks_used == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine still busy: {engine.stats()}")


def test_greedy_reply_streams_and_is_correct(registry):
    _, history, _, _ = add_user_message("What is the capital of France?", [], False)
    outputs = collect(generate_reply(registry, history, *GREEDY.values()))
    replies = [out[1][-1]["content"] for out in outputs]
    assert len(replies) > 3  # streamed: one update per token, not one at the end
    assert all(later.startswith(earlier) for earlier, later in zip(replies, replies[1:]))
    assert replies[-1] == "The capital of France is Paris."
    assert outputs[-1][0][-1] == {"role": "assistant", "content": "The capital of France is Paris."}


def test_same_seed_gives_the_same_sampled_reply(registry):
    sampled = dict(temperature=1.0, seed="1234", max_tokens=16)
    first = reply_of(ask(registry, "Tell me a joke.", **sampled)[1])
    assert reply_of(ask(registry, "Tell me a joke.", **sampled)[1]) == first


def test_stop_sequence_cuts_the_reply(registry):
    history = ask(registry, "What is the capital of France?", stop="Paris")[1]
    assert reply_of(history) == "The capital of France is "


def test_max_tokens_limits_the_reply_and_says_so(registry):
    _, history, notice = ask(registry, "Write a long story about a dragon.", max_tokens=5)
    assert len(history[-1]["tokens"]) == 5
    assert "limit of 5 new tokens" in notice


def test_system_prompt_reaches_the_template(registry):
    pirate = "You are a pirate. Start every answer with Arr!"
    assert build_messages([{"role": "user", "content": "hi"}], pirate)[0] == {"role": "system", "content": pirate}
    assert reply_of(ask(registry, "What is your name?", system_prompt=pirate)[1]).startswith("Arr")
    assert not reply_of(ask(registry, "What is your name?")[1]).startswith("Arr")


def test_conversation_is_multi_turn(registry):
    first = ask(registry, "My name is Alice.")[1]
    second = ask(registry, "What is my name?", first)[1]
    assert [turn["role"] for turn in second] == ["user", "assistant", "user", "assistant"]
    # The earlier turns are in the prompt: the same question asked fresh gets a different greedy answer.
    assert reply_of(second) != reply_of(ask(registry, "What is my name?")[1])


def test_retry_regenerates_the_last_turn(registry):
    sampled = dict(temperature=1.0, max_tokens=12)
    history = ask(registry, "Tell me a joke.", seed="1", **sampled)[1]
    retried, chatbot, _ = drop_last_reply(history, False)
    assert retried == history[:-1] and len(chatbot) == 1
    regenerated = chat(registry, retried, seed="2", **sampled)[1]
    assert len(regenerated) == 2 and regenerated[0] == history[0]
    assert reply_of(regenerated) != reply_of(history)


def test_clear_empties_the_conversation():
    assert asyncio.run(clear_chat(ChatSession())) == ([], [], "")


def test_clear_mid_stream_ends_the_reply_and_nothing_comes_back(registry):
    """Clear races Gradio's cancellation of the reply: should tokens arrive first, the reply must not write the
    cleared conversation back; it ends, and the engine drops the request. Clear answers only once the reply has
    ended, so its empty conversation is the last update the page gets."""
    _, history, _, _ = add_user_message("Write a very long story about a dragon.", [], False)
    session = ChatSession()

    async def clear_after_two_updates():
        replies = generate_reply(registry, history, *{**GREEDY, "session": session, "max_tokens": 100}.values())
        await replies.__anext__()
        await replies.__anext__()
        clearing = asyncio.create_task(clear_chat(session))
        await asyncio.sleep(0)  # Clear has run up to its wait
        assert not clearing.done()  # the reply still streams: Clear has not answered yet
        after_clear = [out async for out in replies]
        return await clearing, after_clear

    cleared, after_clear = asyncio.run(clear_after_two_updates())
    assert cleared == ([], [], "") and after_clear == []
    wait_until_idle(engine_of(registry))
    # The next conversation in the same tab is answered as usual.
    _, history, _, _ = add_user_message("What is the capital of France?", [], False)
    assert reply_of(chat(registry, history, session=session)[1]) == "The capital of France is Paris."


def test_blank_message_is_not_sent():
    assert add_user_message("   ", [], False)[1] == []


def test_token_probabilities_colour_the_reply(registry):
    history = ask(registry, "What is the capital of France?")[1]
    tokens = history[-1]["tokens"]
    assert "".join(t.text for t in tokens) == reply_of(history)  # EOS is left out of the view
    assert all(t.logprob <= 0 and len(t.alternatives) == 5 for t in tokens)
    plain, coloured = render_chatbot(history, False), render_chatbot(history, True)
    assert plain[-1]["content"] == reply_of(history)
    assert coloured[-1]["content"].count('class="tern-token"') == len(tokens)
    assert coloured[0] == plain[0]  # the user's turn stays as typed


def test_token_view_switches_while_a_reply_streams(registry):
    """Ticking the checkbox mid-stream colours the reply at once and it keeps streaming coloured; unticking
    switches it back to plain text, still streaming."""
    _, history, _, _ = add_user_message("Write a very long story about a dragon.", [], False)
    session = ChatSession(show_probs=False)

    def shown(chatbot: list[dict], turns: list[dict]) -> tuple[str, int]:
        """(the reply as shown, its number of tokens), taken now: the generator keeps growing the same turn."""
        return chatbot[-1]["content"], len(turns[-1]["tokens"])

    async def toggle_twice_mid_stream():
        replies = generate_reply(registry, history, *{**GREEDY, "session": session, "max_tokens": 40}.values())
        plain = [shown(*(await replies.__anext__())[:2]) for _ in range(3)]
        _, turns, _ = await replies.__anext__()
        chatbot, legend = show_token_view(session, turns, True)  # what the checkbox's handler does
        toggled = shown(chatbot, turns)
        coloured = [shown(*(await replies.__anext__())[:2]) for _ in range(3)]
        _, turns, _ = await replies.__anext__()
        chatbot, legend_after = show_token_view(session, turns, False)
        untoggled = shown(chatbot, turns)
        rest = [shown(*out[:2]) async for out in replies]
        return plain, (toggled, legend), coloured, untoggled, legend_after, rest

    plain, (toggled, legend), coloured, untoggled, legend_after, rest = asyncio.run(toggle_twice_mid_stream())
    assert all("tern-token" not in content for content, _ in plain)
    # At once: the chatbot the checkbox's handler returns is coloured, token for token, and the legend appears.
    assert toggled[0].count('class="tern-token"') == toggled[1] and legend["visible"] is True
    # The stream goes on in the new view: more tokens, each coloured.
    assert all(content.count('class="tern-token"') == num_tokens for content, num_tokens in coloured)
    assert toggled[1] < coloured[0][1] < coloured[-1][1]
    # And back: plain text at once, and for the rest of the reply.
    assert "tern-token" not in untoggled[0] and legend_after["visible"] is False
    assert rest and all("tern-token" not in content for content, _ in rest)
    assert rest[-1][1] == 40 and coloured[-1][1] < rest[0][1]


def test_stop_aborts_the_request_in_the_engine(registry):
    """Gradio's Stop cancels the task that drives the handler; the handler must abort the engine request."""
    _, history, _, _ = add_user_message("Write a very long story about a dragon.", [], False)

    async def stop_after_three_updates():
        updates = []

        async def drive():
            async for out in generate_reply(registry, history, *{**GREEDY, "max_tokens": 500}.values()):
                updates.append(out)

        task = asyncio.create_task(drive())
        while len(updates) < 3:
            await asyncio.sleep(0.01)
        assert engine_of(registry).stats().num_running == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return updates

    updates = asyncio.run(stop_after_three_updates())
    wait_until_idle(engine_of(registry))
    assert len(updates[-1][1][-1]["tokens"]) < 500


def test_closing_the_stream_early_also_aborts(registry):
    _, history, _, _ = add_user_message("Write a very long story about a dragon.", [], False)

    async def read_two_then_close():
        agen = generate_reply(registry, history, *{**GREEDY, "max_tokens": 500}.values())
        await agen.__anext__()
        await agen.__anext__()
        await agen.aclose()

    asyncio.run(read_two_then_close())
    wait_until_idle(engine_of(registry))


def test_too_long_prompt_is_a_readable_message_and_the_chat_keeps_working(tiny_engine_factory):
    engine, _ = tiny_engine_factory(max_model_len=64)
    tiny = tiny_served(engine)
    with pytest.warns(UserWarning, match="maximum context length is 64"):
        _, history, notice = ask(tiny, "word " * 100)
    assert notice.startswith("\u26a0\ufe0f") and "maximum context length is 64" in notice
    assert history[-1]["role"] == "user"  # nothing half-made was added
    _, history, notice = ask(tiny, "hi", max_tokens=4)
    assert history[-1]["role"] == "assistant" and len(history[-1]["tokens"]) >= 1


def test_too_long_prompts_in_complete_and_score_are_readable_messages(tiny_engine_factory):
    engine, _ = tiny_engine_factory(max_model_len=64)
    tiny = tiny_served(engine)
    with pytest.warns(UserWarning, match="maximum context length is 64"):
        text, _, status = collect(complete_text(tiny, "word " * 100, False, 0.0, 1.0, 0, 4, "", ""))[-1]
    assert text == "" and status.startswith("\u26a0\ufe0f") and "maximum context length is 64" in status
    with pytest.warns(UserWarning, match="maximum context length is 64"):
        table, _, notice = score(tiny, "word " * 100, " a\n b")
    assert table["data"] == [] and "maximum context length is 64" in notice
    assert collect(complete_text(tiny, "word", False, 0.0, 1.0, 0, 4, "", ""))[-1][0]  # still serving


def test_a_shutdown_cuts_a_reply_short_and_refuses_new_ones_with_a_message(tiny_engine_factory):
    engine, _ = tiny_engine_factory()
    tiny = tiny_served(engine)
    _, history, _, _ = add_user_message("hi", [], False)

    async def shut_down_mid_reply():
        replies = generate_reply(tiny, history, *{**GREEDY, "max_tokens": 480}.values())
        first = await replies.__anext__()
        tiny.drain()
        engine.abort_all()  # what a shutdown does once its drain timeout is over
        return [first, *[out async for out in replies]]

    _, cut, notice = asyncio.run(shut_down_mid_reply())[-1]
    assert "shutting down" in notice and 0 < len(cut[-1]["tokens"]) < 480
    with pytest.warns(UserWarning, match="shutting down"):
        assert "takes no new requests" in ask(tiny, "hello")[2]


def test_more_stop_sequences_than_allowed_is_a_readable_message(registry):
    with pytest.warns(UserWarning, match="at most 16 stop strings"):
        notice = ask(registry, "hi", stop="\n".join(f"s{i}" for i in range(17)))[2]
    assert "at most 16 stop strings" in notice


def test_bad_seed_is_a_readable_message(registry):
    with pytest.warns(UserWarning, match="whole number"):
        notice = ask(registry, "hi", seed="abc")[2]
    assert "seed must be a whole number" in notice


def test_model_still_loading_at_start_is_a_message_not_a_crash(tiny_engine_factory):
    """A model the server loads at start (not on demand) answers "still loading" until it is up, then serves."""
    may_finish = threading.Event()

    def slow_load():
        assert may_finish.wait(60)
        return tiny_engine_factory()[0]

    loading = registry_over({"tiny": slow_load}, preload=False)
    try:
        loading.start(preload=["tiny"])
        with pytest.warns(UserWarning, match="still loading"):
            assert "still loading" in ask(loading, "hi")[2]
        assert "Loading" in describe_model(loading)
        assert live_stats(loading.handle()) == [["Engine", "not running yet"]]
        assert dict(model_facts(loading))["Status"] == "loading\u2026"
        may_finish.set()
        loading.handle().wait(60)
        assert ask(loading, "hi", max_tokens=2)[1][-1]["role"] == "assistant"
    finally:
        may_finish.set()
        loading.stop()


def test_complete_uses_the_raw_prompt_without_a_chat_template(registry):
    prompt = "The capital of France is"
    outputs = collect(complete_text(registry, prompt, True, 0.0, 1.0, 0, 12, "", ""))
    text, tokens_html, status = outputs[-1]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    expected = asyncio.run(engine_of(registry).complete(prompt, greedy)).choices[0].text
    assert text == expected and len(outputs) > 1
    assert tokens_html.count('class="tern-token"') >= 1
    assert "finished" in status and "12 generated" in status


def test_complete_stop_sequence_and_hidden_logprobs(registry):
    text, tokens_html, status = collect(complete_text(registry, "1, 2, 3, 4,", False, 0.0, 1.0, 0, 20, "", " 7"))[-1]
    assert text.startswith(" 5, 6,") and "7" not in text
    assert tokens_html == "" and "stop sequence ' 7'" in status


def test_score_ranks_continuations(registry):
    table, tokens_html, notice = score(registry, "The capital of France is", " a banana\n Paris")
    rows = table["data"]
    assert [row[1] for row in rows] == ["\u201c Paris\u201d", "\u201c a banana\u201d"]
    assert rows[0][2] > rows[1][2] and rows[0][-1] == "yes" and rows[1][-1] == "no"
    assert tokens_html.count('class="tern-token"') == rows[0][5] + rows[1][5]
    assert "Paris" in notice


def test_score_errors_are_messages(registry):
    with pytest.warns(UserWarning, match="at least one continuation"):
        assert "at least one continuation" in score(registry, "The sky is", "\n  \n")[2]
    with pytest.warns(UserWarning, match="context must not be empty"):
        assert "context must not be empty" in score(registry, "", " blue")[2]


def test_server_tab_describes_the_model_and_the_sdk(registry):
    facts = dict(model_facts(registry))
    assert facts["Model id"] == "SmolLM2-135M-Instruct"
    assert facts["Parameters"].startswith("134.5M") and facts["Dtype"] == "float32" and facts["Device"] == "cpu"
    assert facts["Max context"] == "8,192 tokens" and "weights" in facts["Memory"]
    assert facts["Memory"].endswith("KV cache in float32)")  # the tests' engine keeps the model's dtype
    assert dict(live_stats(registry.handle()))["Running requests"] == "0"
    snippet = openai_snippet(registry.default_id, gr.Request(headers={"host": "localhost:7860"}))
    assert 'base_url="http://localhost:7860/v1"' in snippet and 'model="SmolLM2-135M-Instruct"' in snippet
    compile(snippet, "snippet", "exec")
    assert "SmolLM2-135M-Instruct" in describe_model(registry)


def test_two_users_generate_at_the_same_time(registry):
    """No global lock: both conversations are in the engine together and both get the right answer."""
    _, history, _, _ = add_user_message("What is the capital of France?", [], False)
    seen_running = []

    async def one_user():
        last = None
        async for last in generate_reply(registry, history, *GREEDY.values()):
            seen_running.append(engine_of(registry).stats().num_running)
        return reply_of(last[1])

    async def two_users():
        return await asyncio.gather(one_user(), one_user())

    assert asyncio.run(two_users()) == ["The capital of France is Paris."] * 2
    assert max(seen_running) == 2


# A JSON schema for the reply.
def test_a_json_schema_holds_the_reply_and_it_shows_indented_and_validated(registry):
    _, history, _, _ = add_user_message("What is the capital of France? Answer in JSON.", [], False)
    args = {**GREEDY, "max_tokens": 64, "schema_text": json.dumps(CITY)}
    outputs = collect(generate_reply(registry, history, *args.values()))
    chatbot, history, notice = outputs[-1]
    raw = reply_of(history)
    value = json.loads(raw)
    jsonschema.validate(value, CITY)
    assert value["city"] == "Paris" and notice == ""
    shown = chatbot[-1]["content"]
    assert shown.startswith(f"```json\n{json.dumps(value, indent=2)}\n```") and VALID_MARK in shown
    # While streaming: the raw text so far, in a code block, and no mark yet.
    streamed = [out[0][-1]["content"] for out in outputs[:-1]]
    assert len(streamed) > 3 and all(s.startswith("```json\n") and VALID_MARK not in s for s in streamed)
    # The next turn's prompt holds the raw reply, not the rendered block.
    assert build_messages(history, "")[-1] == {"role": "assistant", "content": raw}
    # The token view still works: every token coloured, their text the raw reply, and the mark under them.
    coloured = render_chatbot(history, True)[-1]["content"]
    assert "".join(t.text for t in history[-1]["tokens"]) == raw
    assert coloured.count('class="tern-token"') == len(history[-1]["tokens"]) and VALID_MARK in coloured


@pytest.mark.parametrize("seed", ["1", "2", "3"])
def test_a_random_model_under_a_schema_writes_valid_json(tiny_engine_factory, seed):
    """The grammar, not the weights, makes the JSON valid: random weights, sampled, still give it."""
    engine, _ = tiny_engine_factory()
    tiny = tiny_served(engine)
    chatbot, history, _ = ask(tiny, "Describe an animal.", temperature=1.0, seed=seed, max_tokens=400,
                              schema_text=json.dumps(ANIMAL))
    jsonschema.validate(json.loads(reply_of(history)), ANIMAL)
    assert VALID_MARK in chatbot[-1]["content"]


@pytest.mark.parametrize(
    ("schema_text", "message"),
    [
        ('{"type": "object", ', "The JSON schema is not valid JSON"),
        ('["city", "country"]', "must be a JSON object"),
        ('{"type": "strin"}', "not a valid JSON Schema: 'strin' is not valid"),
        # Valid JSON Schema, but no value satisfies it: the engine refuses to compile it.
        ('{"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["n"]}',
         "cannot be held to this schema: Unsatisfiable schema"),
    ],
    ids=["not-json", "not-an-object", "not-a-schema", "unsatisfiable"],
)
def test_a_bad_schema_is_a_message_and_nothing_is_generated(registry, schema_text, message):
    _, history, _, _ = add_user_message("What is the capital of France?", [], False)
    generated_before = engine_of(registry).stats().num_generated_tokens
    with pytest.warns(UserWarning, match=message.split(":")[0]):
        outputs = collect(generate_reply(registry, history, *{**GREEDY, "schema_text": schema_text}.values()))
    (chatbot, kept, notice), = outputs
    assert notice.startswith("\u26a0\ufe0f") and message in notice
    assert kept == history and len(chatbot) == 1  # nothing half-made was added
    assert engine_of(registry).stats().num_generated_tokens == generated_before
    # The conversation stays usable: with the schema cleared, the same turn gets its answer.
    assert reply_of(chat(registry, kept)[1]) == "The capital of France is Paris."


def test_a_blank_schema_is_free_text_as_before(registry):
    for blank in ("", "  \n "):
        chatbot, history, _ = ask(registry, "What is the capital of France?", schema_text=blank)
        assert reply_of(history) == "The capital of France is Paris."
        assert chatbot[-1] == {"role": "assistant", "content": "The capital of France is Paris."}


def test_a_schema_reply_cut_by_max_tokens_says_it_is_not_valid_json(registry):
    chatbot, history, notice = ask(registry, "What is the capital of France? Answer in JSON.", max_tokens=5,
                                   schema_text=json.dumps(CITY))
    raw = reply_of(history)
    assert len(history[-1]["tokens"]) == 5 and raw.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(raw)
    shown = chatbot[-1]["content"]
    assert shown.startswith(f"```json\n{raw}\n```")  # the raw text, not indented: it is not JSON
    assert "Not valid JSON: the reply stopped at the limit of 5 new tokens" in shown and VALID_MARK not in shown
    assert "limit of 5 new tokens" in notice
