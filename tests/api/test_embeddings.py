"""POST /v1/embeddings on the tiny model behind the real routes: OpenAI's shape, both encodings, every input shape,
and a clear 400 (OpenAI's error shape, the field at fault) for each input that cannot be served."""
from __future__ import annotations

import base64

import numpy as np
import pytest

from api.protocol import MAX_PROMPTS

HIDDEN_SIZE = 64  # tests/conftest.py tiny_config's


def _post(client, **body):
    return client.post("/v1/embeddings", json=body)


def _vectors(response) -> list[np.ndarray]:
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [item["index"] for item in data] == list(range(len(data)))
    assert all(item["object"] == "embedding" for item in data)
    return [np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") if isinstance(item["embedding"], str)
            else np.asarray(item["embedding"], dtype=np.float32) for item in data]


def test_each_input_shape_gives_one_unit_vector_per_input_in_order(tiny_api):
    engine, client = tiny_api
    texts = ["The quick brown fox", "jumps over the lazy dog", "The quick brown fox"]
    response = _post(client, input=texts, model=engine.model_name, user="someone")
    body = response.json()
    assert body["object"] == "list" and body["model"] == engine.model_name
    num_tokens = sum(len(engine.tokenizer.encode(t)) for t in texts)
    assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    first, second, again = _vectors(response)
    for vector in (first, second):
        assert vector.shape == (HIDDEN_SIZE,) and abs(np.linalg.norm(vector) - 1) < 1e-5
    np.testing.assert_allclose(first, again, atol=1e-6)
    assert not np.allclose(first, second, atol=1e-3)
    # One string, one token-id list and a list of them: the same input, the same vector.
    ids = engine.tokenizer.encode("The quick brown fox")
    for single in (_post(client, input="The quick brown fox"), _post(client, input=ids), _post(client, input=[ids])):
        [vector] = _vectors(single)
        np.testing.assert_allclose(vector, first, atol=1e-6)


def test_base64_is_the_same_float32_vector(tiny_api):
    _, client = tiny_api
    [as_floats] = _vectors(_post(client, input="Hello there", encoding_format="float"))
    response = _post(client, input="Hello there", encoding_format="base64")
    assert isinstance(response.json()["data"][0]["embedding"], str)
    [as_base64] = _vectors(response)
    assert as_base64.dtype == np.float32 and np.array_equal(as_base64, as_floats)


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": "Hello", "dimensions": 32}, "dimensions", f"have {HIDDEN_SIZE} dimensions"),
        ({"input": ""}, "input", "input is an empty string"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": ["Hello", ""]}, "input", "input[1] is an empty string"),
        ({"input": [[5, 6], []]}, "input", "input[1] is an empty list"),
        ({"input": [5, 10**9]}, "input", "outside the vocabulary"),
        ({"input": [-1]}, "input", "outside the vocabulary"),
        ({"input": ["x"] * (MAX_PROMPTS + 1)}, "input", f"at most {MAX_PROMPTS} inputs"),
        ({"input": "Hello", "encoding_format": "float16"}, "encoding_format", ""),
        ({"input": [1.5]}, "input", ""),
        ({}, "input", "Missing required parameter"),
    ],
)
def test_inputs_that_cannot_be_served_get_a_400_naming_the_field(tiny_api, body, param, says):
    _, client = tiny_api
    response = _post(client, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert says in error["message"]
    [vector] = _vectors(_post(client, input="Hello", dimensions=HIDDEN_SIZE))  # the server still serves
    assert vector.shape == (HIDDEN_SIZE,)


def test_an_input_longer_than_the_context_is_refused(tiny_api):
    engine, client = tiny_api
    too_long = [5] * (engine.max_model_len + 1)
    response = _post(client, input=[[5, 6], too_long])
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "input" and "input[1]" in error["message"]
    assert engine.stats().num_waiting == 0  # nothing was queued, the short input neither


def test_an_unknown_model_is_a_404(tiny_api):
    _, client = tiny_api
    response = _post(client, input="Hello", model="text-embedding-3-small")
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"
