"""Two models on Ray Serve in one application (a --models file: two ids over the tiny checkpoint), one replica
deployment each: the ingress sends each request to the replicas of the model it names, the first model takes a
request naming none, an unknown id is a 404 naming both (Anthropic's shape on /v1/messages), /v1/models lists both,
and /metrics shows each model's tokens coming from its own replica only."""
from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from conftest import deploy_on_ray, undeploy_from_ray

pytestmark = pytest.mark.slow
pytest.importorskip("ray.serve", reason="Ray is not installed: pip install -r requirements-ray.txt")

MODELS = ("tiny-a", "tiny-b")


@pytest.fixture(scope="module")
def base_url(ray_serve, tiny_checkpoint, tmp_path_factory):
    models_file = tmp_path_factory.mktemp("ray-models") / "models.yaml"
    models_file.write_text("models:\n" + "".join(f"  - id: {model_id}\n    path: {tiny_checkpoint}\n"
                                                 for model_id in MODELS))
    deploy_on_ray("--models", str(models_file), replicas=1)
    yield ray_serve
    undeploy_from_ray()


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)


def completion_tokens_by_replica(base_url: str, model_id: str) -> dict[str, float]:
    """tern_completion_tokens_total of one model, per replica, from the ingress's merged /metrics."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    found: dict[str, float] = {}
    for labels, value in re.findall(r"^tern_completion_tokens_total\{([^}]*)\} (\S+)$", text, re.M):
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if pairs.get("model") == model_id:
            found[pairs["replica"]] = float(value)
    return found


def test_each_request_goes_to_the_replicas_of_the_model_it_names(base_url, client):
    assert [model.id for model in client.models.list().data] == list(MODELS)

    replica_of = {}
    for model_id in MODELS:
        raw = client.chat.completions.with_raw_response.create(
            model=model_id, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert raw.parse().model == model_id
        replica_of[model_id] = raw.headers["x-tern-replica"]
    assert replica_of["tiny-a"] != replica_of["tiny-b"]  # a deployment per model, not one serving both

    unnamed = httpx.post(f"{base_url}/v1/completions", json={"prompt": "Terns", "max_tokens": 1}, timeout=120)
    assert unnamed.status_code == 200 and unnamed.json()["model"] == "tiny-a"  # the first model
    assert unnamed.headers["x-tern-replica"] == replica_of["tiny-a"]

    # Each model's tokens were counted by its own replica, and by no replica of the other model. The board hears
    # from each replica every second: wait until both models' tokens have arrived.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        tokens = {model_id: completion_tokens_by_replica(base_url, model_id) for model_id in MODELS}
        if all(sum(by_replica.values()) >= 2 for by_replica in tokens.values()):
            break
        time.sleep(0.25)
    for model_id in MODELS:
        assert {rid for rid, n in tokens[model_id].items() if n > 0} == {replica_of[model_id]}, tokens


def test_an_unknown_model_is_a_404_naming_the_served_ones_in_each_apis_shape(base_url, client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="tiny-c", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    error = caught.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "`tiny-c`" in error["message"] and "`tiny-a`" in error["message"] and "`tiny-b`" in error["message"]

    body = {"model": "tiny-c", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    answer = httpx.post(f"{base_url}/v1/messages", json=body, timeout=30)
    assert answer.status_code == 404
    assert answer.json()["type"] == "error" and answer.json()["error"]["type"] == "not_found_error"
    assert "`tiny-b`" in answer.json()["error"]["message"]

    assert client.models.retrieve("tiny-b").id == "tiny-b"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("tiny-c")
