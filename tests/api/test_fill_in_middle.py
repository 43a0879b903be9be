"""Fill-in-the-middle on /v1/completions: `suffix` on a tiny random model whose tokenizer has StarCoder's FIM tokens
(the default tokenizer plus the three), and the 400 for a tokenizer without them (the default model's own)."""
from __future__ import annotations

import copy
import json

import pytest
from conftest import api_app, build_tiny, tiny_config
from fastapi.testclient import TestClient

from engine import Engine, EngineConfig

COMPLETIONS = "/v1/completions"
FIM = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]
PREFIX, SUFFIX = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def fim_api(default_tokenizer):
    """(tokenizer, TestClient) of a tiny llama whose vocabulary ends with the three FIM tokens."""
    tokenizer = copy.deepcopy(default_tokenizer)
    tokenizer.add_tokens(FIM, special_tokens=True)
    _, loaded = build_tiny(tiny_config(vocab_size=len(tokenizer)), tokenizer)
    engine = Engine(EngineConfig(dtype="float32"), loaded=loaded).start()
    try:
        with TestClient(api_app(engine)) as client:
            yield tokenizer, client
    finally:
        engine.stop()


def _psm_ids(tokenizer, prefix_ids: list[int]) -> list[int]:
    fim_prefix, fim_suffix, fim_middle = tokenizer.convert_tokens_to_ids(FIM)
    return [fim_prefix, *prefix_ids, fim_suffix, *tokenizer.encode(SUFFIX, add_special_tokens=False), fim_middle]


@pytest.mark.parametrize("prompt_as_ids", [False, True])
def test_suffix_asks_for_the_middle_in_psm_order(fim_api, prompt_as_ids):
    tokenizer, client = fim_api
    prefix_ids = tokenizer.encode(PREFIX, add_special_tokens=False)
    body = {"prompt": prefix_ids if prompt_as_ids else PREFIX, "suffix": SUFFIX, "max_tokens": 8, "temperature": 0}
    answer = client.post(COMPLETIONS, json=body)
    assert answer.status_code == 200, answer.text
    # The same model given the PSM prompt spelled out as token ids writes the same middle.
    spelled = client.post(COMPLETIONS, json={"prompt": _psm_ids(tokenizer, prefix_ids), "max_tokens": 8,
                                             "temperature": 0}).json()
    assert answer.json()["choices"][0]["text"] == spelled["choices"][0]["text"]
    assert answer.json()["usage"]["prompt_tokens"] == len(_psm_ids(tokenizer, prefix_ids))


def test_suffix_streams_and_takes_several_prompts(fim_api):
    _, client = fim_api
    whole = client.post(COMPLETIONS, json={"prompt": [PREFIX, "x = "], "suffix": SUFFIX, "max_tokens": 6,
                                           "temperature": 0}).json()
    with client.stream("POST", COMPLETIONS, json={"prompt": [PREFIX, "x = "], "suffix": SUFFIX, "max_tokens": 6,
                                                  "temperature": 0, "stream": True}) as response:
        body = "".join(response.iter_text())
    streamed = {}
    for line in body.split("\n\n"):
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                streamed[choice["index"]] = streamed.get(choice["index"], "") + choice["text"]
    assert streamed == {c["index"]: c["text"] for c in whole["choices"]}


def test_echo_with_suffix_is_a_400(fim_api):
    _, client = fim_api
    answer = client.post(COMPLETIONS, json={"prompt": PREFIX, "suffix": SUFFIX, "echo": True, "max_tokens": 2})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "echo"


def test_a_model_without_fim_tokens_refuses_suffix_and_goes_on(tiny_api):
    _, client = tiny_api  # the default model's tokenizer: StarCoder's <repo_name> family but no FIM tokens
    answer = client.post(COMPLETIONS, json={"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 2})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "suffix" and "FIM" in error["message"]
    assert client.post(COMPLETIONS, json={"prompt": PREFIX, "max_tokens": 2}).status_code == 200
