"""Request bodies: OpenAI names map onto SamplingParams in one place; unsupported features are refused clearly."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from api.errors import OpenAIError
from api.protocol import MAX_N, ChatCompletionRequest, CompletionRequest, template_messages

USER = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **fields})


def test_chat_defaults_run_to_the_end_of_the_context_at_temperature_one():
    params = chat().to_sampling_params()
    assert params.max_tokens is None and params.temperature == 1.0 and params.n == 1 and params.logprobs is None


def test_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_tokens=5, max_completion_tokens=7).to_sampling_params().max_tokens == 7
    assert chat(max_tokens=5).to_sampling_params().max_tokens == 5


def test_every_sampling_field_reaches_the_engine():
    params = chat(
        temperature=0.5, top_p=0.9, n=3, stop="END", seed=7, presence_penalty=0.5, frequency_penalty=-0.5,
        logit_bias={"42": -100}, logprobs=True, top_logprobs=4, user="u", top_k=20, min_p=0.05,
        repetition_penalty=1.1, min_tokens=2, ignore_eos=True, stop_token_ids=[2], max_tokens=9,
    ).to_sampling_params()
    assert (params.temperature, params.top_p, params.n, params.stop, params.seed) == (0.5, 0.9, 3, ("END",), 7)
    assert (params.presence_penalty, params.frequency_penalty, params.logit_bias) == (0.5, -0.5, {42: -100.0})
    assert (params.logprobs, params.top_k, params.min_p, params.repetition_penalty) == (4, 20, 0.05, 1.1)
    assert (params.min_tokens, params.ignore_eos, params.stop_token_ids, params.max_tokens) == (2, True, (2,), 9)


def test_chat_logprobs_without_alternatives_still_returns_the_token_logprob():
    assert chat(logprobs=True).to_sampling_params().logprobs == 0
    assert chat(logprobs=False).to_sampling_params().logprobs is None


def test_completions_run_to_the_end_of_the_context_and_echo_with_logprobs_scores_the_prompt():
    assert completion().to_sampling_params().max_tokens is None
    params = completion(echo=True, logprobs=1, max_tokens=1, temperature=0).to_sampling_params()
    assert (params.logprobs, params.prompt_logprobs, params.max_tokens, params.temperature) == (1, 1, 1, 0.0)
    assert completion(logprobs=2).to_sampling_params().prompt_logprobs is None  # no echo, no prompt scoring
    assert completion(max_tokens=None).to_sampling_params().max_tokens is None


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1, 2], [3]], [[1, 2], [3]])],
)
def test_the_four_prompt_shapes(prompt, expected):
    assert completion(prompt=prompt).prompts() == expected


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (lambda: chat(top_logprobs=3), "top_logprobs"),
        (lambda: chat(stream_options={"include_usage": True}), "stream_options"),
        (lambda: chat(logit_bias={"not-a-token": 1}), "logit_bias"),
        (lambda: completion(best_of=3), "best_of"),
    ],
)
def test_features_we_do_not_serve_are_refused_with_their_param(request_, param):
    with pytest.raises(OpenAIError) as caught:
        request_().to_sampling_params()
    assert caught.value.status_code == 400 and caught.value.param == param


def test_best_of_equal_to_n_is_the_same_request():
    assert completion(best_of=2, n=2).to_sampling_params().n == 2


def test_empty_prompts_are_refused():
    for prompt in ("", []):
        with pytest.raises(OpenAIError):
            completion(prompt=prompt).prompts()


@pytest.mark.parametrize(
    "fields",
    [
        {"n": MAX_N + 1}, {"top_p": 1.5}, {"top_p": 0}, {"temperature": 2.5}, {"top_logprobs": 21},
        {"max_tokens": 0}, {"presence_penalty": 3}, {"seed": 2**64}, {"messages": []},
        {"messages": [{"role": "wizard", "content": "x"}]},
    ],
)
def test_out_of_range_chat_fields_fail_validation(fields):
    with pytest.raises(ValidationError):
        chat(**fields)


def test_unknown_fields_are_ignored():
    assert chat(some_future_field={"x": 1}, prompt_cache_key="k").to_sampling_params().n == 1


def test_template_messages_are_text_and_developer_is_a_system_prompt():
    request = chat(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ])
    assert template_messages(request.messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "one\ntwo"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]


def test_image_parts_are_refused_naming_the_part():
    request = chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(OpenAIError) as caught:
        template_messages(request.messages)
    assert caught.value.param == "messages[0].content[0]"
