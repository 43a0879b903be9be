"""The openai SDK's client.embeddings.create against the real server on the default model: unit vectors of the hidden
size, deterministic, the same whether they travel as floats or base64, from text or token ids; clear 400s."""
from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import openai
import pytest

pytestmark = pytest.mark.slow

TEXTS = ["Paris is the capital of France.", "A recipe for bread needs flour, water and yeast.",
         "Paris is the capital of France."]


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    # No retries: a retried request would hide a 5xx that should have been a 4xx.
    return openai.OpenAI(base_url=f"{live_server}/v1", api_key="unused", max_retries=0, timeout=120.0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def hidden_size(default_checkpoint) -> int:
    return json.loads((default_checkpoint / "config.json").read_text())["hidden_size"]


def test_a_list_of_strings_gives_unit_vectors_of_the_hidden_size_the_same_as_floats_or_base64(client, model,
                                                                                               hidden_size):
    as_sdk_default = client.embeddings.create(model=model, input=TEXTS)  # the SDK asks for base64 and decodes it
    as_floats = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    for response in (as_sdk_default, as_floats):
        assert [item.index for item in response.data] == [0, 1, 2] and response.model == model
        assert response.usage.prompt_tokens == response.usage.total_tokens > len(TEXTS)
    vectors = [np.asarray(item.embedding) for item in as_floats.data]
    # Separate requests: the same vector up to the float order of what else shared their steps (~1e-7).
    for vector, decoded in zip(vectors, as_sdk_default.data):
        assert vector.shape == (hidden_size,) and abs(np.linalg.norm(vector) - 1) < 1e-5
        np.testing.assert_allclose(np.asarray(decoded.embedding), vector, atol=1e-6)
    np.testing.assert_allclose(vectors[0], vectors[2], atol=1e-5)  # the same text twice in one request
    assert not np.allclose(vectors[0], vectors[1], atol=1e-3)
    raw = client.embeddings.create(model=model, input=TEXTS, encoding_format="base64").data
    assert all(isinstance(item.embedding, str) for item in raw)  # asked for explicitly, the SDK leaves it encoded
    for item, vector in zip(raw, vectors):
        np.testing.assert_allclose(np.frombuffer(base64.b64decode(item.embedding), dtype="<f4"), vector, atol=1e-6)


def test_token_id_input_is_embedded_as_its_text(client, model, live_server):
    ids = httpx.post(f"{live_server}/tokenize", json={"prompt": TEXTS[0]}).json()["tokens"]
    [from_text] = client.embeddings.create(model=model, input=TEXTS[0], encoding_format="float").data
    from_ids = client.embeddings.create(model=model, input=[ids, ids[:3]], encoding_format="float")
    np.testing.assert_allclose(from_ids.data[0].embedding, from_text.embedding, atol=1e-5)
    assert from_ids.usage.prompt_tokens == len(ids) + 3


def test_inputs_that_cannot_be_embedded_are_400s_naming_the_field(client, model, live_server, hidden_size):
    max_model_len = httpx.get(f"{live_server}/tokenizer_info").json()["model_max_length"]
    for options, param, code in [
        ({"input": ""}, "input", "invalid_value"),
        ({"input": ["a text", ""]}, "input", "invalid_value"),
        ({"input": [[5] * (max_model_len + 1)]}, "input", "context_length_exceeded"),
        ({"input": [[1, 10**7]]}, "input", "invalid_value"),
        ({"input": "a text", "dimensions": hidden_size // 2}, "dimensions", "invalid_value"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            client.embeddings.create(model=model, encoding_format="float", **options)
        assert (info.value.param, info.value.code) == (param, code), options
    [ok] = client.embeddings.create(model=model, input="a text", dimensions=hidden_size).data
    assert len(ok.embedding) == hidden_size
