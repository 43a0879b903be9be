"""The official `openai` SDK, sync and async, against the real server: every route and request option of the issue,
checked by what a user sees in the answer (the text, the finish reason, the usage, the logprobs)."""
from __future__ import annotations

import asyncio
import json
import uuid
from typing import Literal, Optional

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from engine import kernels

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."
PROMPT = "The capital of France is"
TIMEOUT_S = 120.0  # 2 shared CPU cores; a generous bound, never an assertion on speed


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    # No retries: a retried request would hide a 5xx that should have been a 4xx.
    return openai.OpenAI(base_url=f"{live_server}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def token_id(live_server: str, text: str) -> int:
    [token] = httpx.post(f"{live_server}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    return token


def ask(client, model, **options):
    return client.chat.completions.create(model=model, messages=QUESTION, temperature=0, **options)


# Models.
def test_the_served_model_is_listed_and_described(client, model):
    [card] = client.models.list().data
    assert card.id == model == "SmolLM2-135M-Instruct"  # the readable default --served-model-name
    assert card.object == "model" and card.owned_by and card.created > 0
    assert card.model_extra["max_model_len"] >= 2048
    assert card.model_extra["quantization"] == "none" and card.model_extra["dtype"] == "float32"
    assert card.model_extra["weight_ratio_to_bf16"] == pytest.approx(2.0, rel=0.01)  # fp32 weights, 2x bf16
    assert card.model_extra["kv_cache_dtype"] == "float32" and card.model_extra["kv_cache_bytes"] > 0  # --kv-cache-dtype auto
    # fp32 weights without a kernel layout: the compiled step, built before /health said ready.
    assert card.model_extra["decode_step"] == "compiled" and card.model_extra["compiled_decode"] is True
    assert card.model_extra["cpu_kernels"].split(" ")[0] == kernels.planned_path()[0]  # the path this CPU takes
    assert client.models.retrieve(model).id == card.id
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    assert caught.value.code == "model_not_found"


# Chat completions.
def test_chat_answers_and_stops_by_itself_when_max_tokens_is_left_out(client, model, default_tokenizer):
    response = ask(client, model)
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion" and response.model == model
    [choice] = response.choices
    assert (choice.index, choice.message.role, choice.message.content) == (0, "assistant", ANSWER)
    assert choice.finish_reason == "stop" and choice.logprobs is None
    usage = response.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # The template is rendered once and not given special tokens again (no doubled BOS).
    expected_ids = default_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert usage.prompt_tokens == len(expected_ids)


def test_streamed_chat_has_openais_sequence_and_the_same_text(client, model):
    expected = ask(client, model)
    chunks = list(ask(client, model, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert chunks[0].id.startswith("chatcmpl-") and all(c.object == "chat.completion.chunk" for c in chunks)
    first, *middle, last_choice, usage_chunk = chunks
    assert (first.choices[0].delta.role, first.choices[0].delta.content) == ("assistant", "")
    assert "".join(c.choices[0].delta.content for c in middle) == expected.choices[0].message.content
    assert last_choice.choices[0].finish_reason == "stop" and last_choice.choices[0].delta.content is None
    assert all(c.choices[0].finish_reason is None for c in [first, *middle])
    assert all(c.usage is None for c in chunks[:-1])
    assert usage_chunk.choices == []
    counts = [(u.prompt_tokens, u.completion_tokens, u.total_tokens) for u in (usage_chunk.usage, expected.usage)]
    assert counts[0] == counts[1]  # cached_tokens may differ: the stream may find the prompt's blocks cached


def test_usage_counts_the_prompt_tokens_served_from_the_prefix_cache(client, model):
    """The second request sharing a long system prompt reports the shared blocks as cached_tokens, as OpenAI does
    (whole 16-token blocks of the prefix cache); a prompt nobody sent before reports none."""
    system = " ".join(f"rule {i}: answer in {i % 7 + 1} words about {uuid.uuid4().hex[:8]}." for i in range(12))
    first, second = (client.chat.completions.create(
        model=model, max_tokens=2, messages=[{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in ("Name a bird.", "Name a fish."))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached % 16 == 0 and 64 <= cached < second.usage.prompt_tokens


def test_without_include_usage_no_chunk_carries_usage(client, model):
    chunks = list(ask(client, model, stream=True, max_tokens=3))
    assert all(c.usage is None and c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_gives_that_many_choices_and_usage_counts_them_all(client, model):
    response = ask(client, model, n=3, max_completion_tokens=4)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert all(c.message.content == "The capital of France" for c in response.choices)  # greedy: all alike
    assert response.usage.completion_tokens == 12


def test_stop_strings_and_stop_token_ids_end_the_text_without_showing_it(client, model, live_server):
    for stop in ("Paris", ["nowhere", "Paris"]):
        choice = ask(client, model, stop=stop).choices[0]
        assert (choice.message.content, choice.finish_reason) == ("The capital of France is ", "stop")
    choice = ask(client, model, extra_body={"stop_token_ids": [token_id(live_server, " Paris")]}).choices[0]
    assert (choice.message.content, choice.finish_reason) == ("The capital of France is", "stop")


def test_length_limits_max_completion_tokens_max_tokens_min_tokens_and_ignore_eos(client, model):
    for limit in ({"max_completion_tokens": 3}, {"max_tokens": 3}):
        response = ask(client, model, **limit)
        assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 3
        assert response.choices[0].message.content == "The capital of"
    # The answer ends after 8 tokens (EOS included); min_tokens or ignore_eos keep it going.
    for extension in ({"min_tokens": 10}, {"ignore_eos": True}):
        response = ask(client, model, max_tokens=10, extra_body=extension)
        assert response.usage.completion_tokens == 10 and response.choices[0].finish_reason == "length"
        assert response.choices[0].message.content.startswith(ANSWER)


def test_seed_makes_sampling_repeatable(client, model):
    def sample(seed: int) -> str:
        options = {"temperature": 1.0, "max_tokens": 6, "seed": seed}
        return client.chat.completions.create(model=model, messages=QUESTION, **options).choices[0].message.content

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_sampling_filters_that_keep_only_the_top_token_are_greedy(client, model):
    greedy = ask(client, model, max_tokens=5).choices[0].message.content
    for options in ({"top_p": 1e-6}, {"extra_body": {"top_k": 1}}, {"extra_body": {"min_p": 1.0}}):
        response = client.chat.completions.create(
            model=model, messages=QUESTION, temperature=1.0, seed=3, max_tokens=5, **options
        )
        assert response.choices[0].message.content == greedy, options


def test_logit_bias_forces_a_token(client, model, live_server):
    paris = token_id(live_server, " Paris")
    response = ask(client, model, max_tokens=3, logit_bias={str(paris): 100})
    assert response.choices[0].message.content == " Paris Paris Paris"


def test_a_reply_that_max_tokens_cuts_inside_an_emoji_leaves_it_out_streamed_or_not(client, model, live_server):
    # The first token of " 😀" holds a space and three of the emoji's four bytes; max_tokens ends the reply there.
    cut = httpx.post(f"{live_server}/tokenize", json={"prompt": " 😀", "add_special_tokens": False}).json()["tokens"][0]
    options = {"max_tokens": 1, "logit_bias": {str(cut): 100}}
    whole = ask(client, model, logprobs=True, **options)
    chunks = list(ask(client, model, stream=True, stream_options={"include_usage": True}, **options))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == streamed == " "  # no U+FFFD for the emoji never finished
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens == 1
    assert [bytes(e.bytes) for e in whole.choices[0].logprobs.content] == [" 😀".encode()[:4]]
    completion = client.completions.create(model=model, prompt=PROMPT, **options)
    assert (completion.choices[0].text, completion.choices[0].finish_reason) == (" ", "length")


def test_penalties_user_and_repetition_penalty_are_accepted(client, model):
    response = ask(
        client, model, max_tokens=6, presence_penalty=1.5, frequency_penalty=1.5, user="user-1",
        extra_body={"repetition_penalty": 1.3, "some_future_field": {"x": 1}},
    )
    assert response.choices[0].finish_reason in ("stop", "length") and response.choices[0].message.content


def test_chat_logprobs_are_openais_content_list(client, model):
    response = ask(client, model, logprobs=True, top_logprobs=3)
    choice = response.choices[0]
    content = choice.logprobs.content
    assert "".join(entry.token for entry in content) == choice.message.content  # the EOS is not shown
    assert b"".join(bytes(entry.bytes) for entry in content).decode() == choice.message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        alternatives = [top.logprob for top in entry.top_logprobs]
        assert alternatives == sorted(alternatives, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # temperature 0 picks the top token
    without_alternatives = ask(client, model, logprobs=True, max_tokens=2).choices[0].logprobs.content
    assert [e.top_logprobs for e in without_alternatives] == [[], []]


def test_streamed_logprobs_add_up_to_the_streamed_text(client, model):
    chunks = list(ask(client, model, stream=True, logprobs=True, top_logprobs=2))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    tokens = [e.token for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert "".join(tokens) == text == ANSWER


def test_every_role_and_text_parts_are_accepted(client, model):
    def answer(messages):
        response = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=4)
        return response.choices[0].message.content, response.usage.prompt_tokens

    system = answer([{"role": "system", "content": "You answer in one word."}, *QUESTION])
    assert answer([{"role": "developer", "content": "You answer in one word."}, *QUESTION]) == system
    parts = [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]
    assert answer([{"role": "user", "content": parts}])[0]
    conversation = [
        *QUESTION,
        {"role": "assistant", "content": ANSWER},
        {"role": "tool", "content": "Paris has 2.1 million inhabitants.", "tool_call_id": "call_1"},
        {"role": "user", "content": "And how many people live there?"},
    ]
    assert answer(conversation)[0]


# Structured output.
class Sighting(BaseModel):
    lat: int = Field(ge=-90, le=90)
    lon: int = Field(ge=-180, le=180)


class Bird(BaseModel):
    """Enum, integer range, string length, array bounds, a nested model ($defs/$ref) and an Optional (anyOf)."""

    name: str = Field(max_length=30)
    kind: Literal["tern", "gull", "other"]
    wingspan_cm: int = Field(ge=10, le=400)
    colours: list[Literal["white", "grey", "black", "orange"]] = Field(min_length=1, max_length=3)
    seen_at: Sighting
    note: Optional[str] = Field(max_length=40)


BIRD_QUESTION = [{"role": "user", "content": "Describe the common tern."}]


def test_parse_returns_the_pydantic_object_streamed_or_not(client, model):
    completion = client.chat.completions.parse(
        model=model, messages=BIRD_QUESTION, response_format=Bird, temperature=0, max_tokens=300)
    [choice] = completion.choices
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Bird)
    assert Bird.model_validate_json(choice.message.content) == choice.message.parsed
    with client.chat.completions.stream(
        model=model, messages=BIRD_QUESTION, response_format=Bird, temperature=0, max_tokens=300
    ) as stream:
        streamed = stream.get_final_completion()
    assert streamed.choices[0].message.parsed == choice.message.parsed


def test_json_object_and_a_raw_json_schema(client, model):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    response = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=100,
                                              response_format={"type": "json_object"})
    assert response.choices[0].finish_reason == "stop"
    assert json.loads(response.choices[0].message.content) == {"city": "Paris"}
    schema = {"type": "object", "properties": {"capital": {"type": "string", "pattern": "^[A-Z][a-z]+$"}},
              "required": ["capital"], "additionalProperties": False}
    response = ask(client, model, max_tokens=100, response_format={
        "type": "json_schema", "json_schema": {"name": "capital", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(response.choices[0].message.content), schema)


def test_a_schema_that_cannot_be_compiled_is_a_bad_request(client, model):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, model, response_format={"type": "json_schema", "json_schema": {
            "name": "broken", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}}}})
    assert caught.value.param == "response_format" and "nowhere" in caught.value.message
    with pytest.raises(openai.LengthFinishReasonError):  # cut short: the SDK will not parse half an object
        client.chat.completions.parse(model=model, messages=BIRD_QUESTION, response_format=Bird, max_tokens=5)


# Completions.
def test_completion_of_a_text_prompt(client, model):
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0)
    assert response.id.startswith("cmpl-") and response.object == "text_completion" and response.model == model
    [choice] = response.choices
    assert (choice.index, choice.text, choice.finish_reason, choice.logprobs) == (0, " Paris.", "length", None)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == (5, 2, 7)


def test_completion_prompts_as_strings_token_ids_and_batches(client, model, live_server):
    ids = httpx.post(f"{live_server}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    for prompt in (PROMPT, [PROMPT], ids, [ids]):
        response = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
        assert [c.text for c in response.choices] == [" Paris."], prompt
    batch = client.completions.create(model=model, prompt=[PROMPT, "1, 2, 3,"], max_tokens=2, temperature=0, n=2)
    # prompt_index * n + sample_index, as OpenAI and vLLM number them.
    assert [(c.index, c.text) for c in batch.choices] == [(0, " Paris."), (1, " Paris."), (2, " 4"), (3, " 4")]
    counting = httpx.post(f"{live_server}/tokenize", json={"prompt": "1, 2, 3,"}).json()["count"]
    assert batch.usage.prompt_tokens == 5 + counting


def test_echo_with_logprobs_returns_the_prompt_and_offsets_from_its_start(client, model):
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=2)
    choice = response.choices[0]
    assert choice.text == PROMPT + " Paris."
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # no context for the first
    for token, offset, logprob, top in zip(logprobs.tokens, logprobs.text_offset, logprobs.token_logprobs, logprobs.top_logprobs):
        assert choice.text[offset : offset + len(token)] == token
        if logprob is not None:
            assert logprob <= 0 and 2 <= len(top) <= 3 and top[token] == logprob
    generated = logprobs.token_logprobs[-2:]
    assert all(lp == max(top.values()) for lp, top in zip(generated, logprobs.top_logprobs[-2:]))  # greedy
    # Without the echo the offsets still count from the prompt's start, as OpenAI's do.
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=2).choices[0]
    assert plain.text == " Paris." and plain.logprobs.tokens == [" Paris", "."]
    assert plain.logprobs.text_offset == logprobs.text_offset[-2:] == [len(PROMPT), len(PROMPT + " Paris")]


def test_streamed_completion_matches_the_whole_one(client, model):
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=1)
    chunks = list(client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=1, stream=True,
        stream_options={"include_usage": True},
    ))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    streamed_tokens = [t for c in text_chunks for t in c.choices[0].logprobs.tokens]
    assert streamed_tokens == whole.choices[0].logprobs.tokens
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage


# Errors as the SDK raises them.
def test_client_mistakes_are_the_sdks_4xx_exceptions_with_openais_fields(client, model):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert (caught.value.code, caught.value.param, caught.value.type) == ("model_not_found", "model", "invalid_request_error")
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, model, logprobs=True, top_logprobs=21)
    assert caught.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=100_000)
    assert caught.value.code == "context_length_exceeded" and "maximum context length" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=PROMPT, suffix="!")
    assert caught.value.param == "suffix"


# The async client.
def test_the_async_client_runs_everything_concurrently(live_server, model):
    async def run():
        async with openai.AsyncOpenAI(
            base_url=f"{live_server}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S
        ) as client:
            async def streamed_chat() -> str:
                stream = await client.chat.completions.create(model=model, messages=QUESTION, temperature=0, stream=True)
                return "".join([c.choices[0].delta.content or "" async for c in stream])

            async def streamed_completion() -> str:
                stream = await client.completions.create(
                    model=model, prompt=PROMPT, max_tokens=2, temperature=0, stream=True
                )
                return "".join([c.choices[0].text async for c in stream])

            return await asyncio.gather(
                client.models.list(),
                client.chat.completions.create(model=model, messages=QUESTION, temperature=0),
                streamed_chat(),
                client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0),
                streamed_completion(),
            )

    models, chat, streamed, completion, streamed_text = asyncio.run(run())
    assert models.data[0].id == model
    assert chat.choices[0].message.content == streamed == ANSWER
    assert completion.choices[0].text == streamed_text == " Paris."


def test_every_decode_step_since_ready_ran_compiled(client, model, live_server):
    """Ready means full speed: the first request after /health said 200 (and every one since, whichever test ran
    first in this module) decoded on the compiled step, never on the eager one a fifth as fast."""
    ask(client, model, max_tokens=8)
    samples = {line.split(" ")[0]: float(line.split(" ")[1])
               for line in httpx.get(f"{live_server}/metrics").text.splitlines() if line.startswith("tern_decode_steps")}
    assert samples.get(f'tern_decode_steps_total{{model="{model}",step="compiled"}}', 0) >= 7
    assert samples.get(f'tern_decode_steps_total{{model="{model}",step="eager"}}', 0) == 0, samples
