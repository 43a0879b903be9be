"""Legacy completions' text_offset through the real route: offsets count from the start of the prompt, echoed or not
(as OpenAI's), for text and token-id prompts, several prompts, n > 1, streamed or not."""
from __future__ import annotations

import pytest

from conftest import sse_chunks

COMPLETIONS = "/v1/completions"
TEXTS = ["The capital of France is", "<|im_start|>user\nName a bird"]


@pytest.fixture(params=["text", "token ids"])
def prompts(request, tiny_api) -> tuple[list, list[str]]:
    """(prompts as sent, each prompt as the answer counts it). Token ids count as they are echoed: decoded, special
    tokens shown; a text prompt counts as sent, even where its tokens hold a special token."""
    engine, _ = tiny_api
    if request.param == "text":
        return TEXTS, TEXTS
    ids = [engine.tokenizer.encode(text, add_special_tokens=False) for text in TEXTS]
    assert [engine.tokenizer.decode(i, skip_special_tokens=False) for i in ids] == TEXTS
    return ids, TEXTS


def test_a_forced_token_sits_right_after_its_prompt(tiny_api, prompts):
    engine, client = tiny_api
    sent, texts = prompts
    [paris] = engine.tokenizer.encode(" Paris", add_special_tokens=False)
    body = {"prompt": sent, "max_tokens": 3, "logprobs": 0, "n": 2, "logit_bias": {str(paris): 100}}
    response = client.post(COMPLETIONS, json=body)
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3], response.text
    for choice in choices:
        start = len(texts[choice["index"] // 2])
        assert choice["text"] == " Paris Paris Paris"
        assert choice["logprobs"]["text_offset"] == [start, start + 6, start + 12]


def test_offsets_are_those_of_the_echoed_answer_streamed_or_not(tiny_api, prompts):
    """Sampled tokens of a random model (partial characters, special tokens, anything): without echo the offsets are
    the echoed answer's completion offsets, which index into prompt + text; a stream's chunks add up to them."""
    _, client = tiny_api
    sent, texts = prompts
    body = {"prompt": sent, "max_tokens": 12, "logprobs": 2, "n": 2, "temperature": 1.0, "seed": 11}
    plain = client.post(COMPLETIONS, json=body).json()["choices"]
    echoed = client.post(COMPLETIONS, json={**body, "echo": True}).json()["choices"]
    streamed: dict[int, list[int]] = {}
    for chunk in sse_chunks(client.post(COMPLETIONS, json={**body, "stream": True})):
        for choice in chunk["choices"]:
            streamed.setdefault(choice["index"], []).extend(choice["logprobs"]["text_offset"])
    assert len(plain) == len(echoed) == len(streamed) == 4
    for choice, echo in zip(plain, echoed):
        prompt, offsets = texts[choice["index"] // 2], choice["logprobs"]["text_offset"]
        assert echo["text"] == prompt + choice["text"]  # the same sample, seeded
        assert offsets == echo["logprobs"]["text_offset"][-len(offsets):]
        assert offsets == streamed[choice["index"]]
        assert offsets[0] == len(prompt) and offsets == sorted(offsets) and offsets[-1] <= len(echo["text"])
