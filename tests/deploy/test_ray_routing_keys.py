"""What the ingress computes to route a prompt is what the engine caches: the same block hashes. And /metrics on Ray
merges every replica's metrics under a replica label. No Ray cluster needed."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import SamplingParams

pytest.importorskip("ray.serve", reason="Ray is not installed: pip install -r requirements-ray.txt")

from deploy.board import merge_metrics  # noqa: E402
from deploy.forwarding import PrefixKeys  # noqa: E402


def test_the_ingress_hashes_a_prompt_as_the_engine_caches_it(tiny_engine_factory):
    engine, _ = tiny_engine_factory()
    keys = PrefixKeys(engine.tokenizer, engine.config.block_size)
    messages = [{"role": "developer", "content": "You know seabirds. " * 8},
                {"role": "user", "content": [{"type": "text", "text": "Where do terns nest?"}]}]
    body = b'{"model": "m", "messages": %s}' % str(messages).replace("'", '"').encode()
    chat_hashes = keys.of("/v1/chat/completions", body)
    prompt = "Terns are seabirds of the family Laridae. " * 4
    completion_hashes = keys.of("/v1/completions", b'{"prompt": "%s"}' % prompt.encode())
    assert len(chat_hashes) >= 3 and len(completion_hashes) >= 2
    assert not set(chat_hashes) & set(engine.cached_prefix_hashes())

    api_messages = [{"role": "system", "content": messages[0]["content"]}, {"role": "user", "content": "Where do terns nest?"}]
    engine.generate([engine.tokenizer.chat_prompt_ids(api_messages), prompt], SamplingParams(max_tokens=1))
    cached = set(engine.cached_prefix_hashes())
    assert set(chat_hashes) <= cached and set(completion_hashes) <= cached
    # What the router cannot know it leaves to load: another route, a malformed body, tools.
    assert keys.of("/v1/models", b"") == keys.of("/v1/completions", b"{oops") == ()
    assert keys.of("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{}]}') == ()



def test_the_keys_of_a_prompt_of_whole_blocks_leave_its_last_block_out_as_the_engine_does(tiny_engine_factory):
    """The last token is always computed (its logits give the next token): a prompt of exactly 3 blocks is cached
    and found under 2 hashes, the ones its keys name."""
    engine, _ = tiny_engine_factory()
    block_size = engine.config.block_size
    keys = PrefixKeys(engine.tokenizer, block_size)
    prompt_ids = [(7 * i) % 500 + 3 for i in range(3 * block_size)]
    hashes = keys.of("/v1/completions", b'{"prompt": %s}' % str(prompt_ids).encode())
    assert len(hashes) == 2
    engine.generate([prompt_ids], SamplingParams(max_tokens=1))
    assert set(hashes) <= set(engine.cached_prefix_hashes())

def replica_metrics(requests: float, running: float | None = None) -> str:
    """A replica's /metrics text, as prometheus_client writes it."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    registry = CollectorRegistry()
    Counter("tern_http_requests", "HTTP requests", ["route"], registry=registry).labels("/v1/models").inc(requests)
    if running is not None:
        Gauge("tern_num_requests_running", "Running", registry=registry).set(running)
    return generate_latest(registry).decode()


def test_metrics_of_replicas_merge_into_one_exposition_labelled_by_replica():
    merged = merge_metrics({"r1": replica_metrics(2), "r2": replica_metrics(3, running=1)})
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    assert merged.count("# TYPE tern_http_requests_total counter") == 1  # each family once, for Prometheus
    totals = [s for s in families["tern_http_requests"].samples if s.name.endswith("_total")]
    assert sorted((s.labels["replica"], s.labels["route"], s.value) for s in totals) == [
        ("r1", "/v1/models", 2.0), ("r2", "/v1/models", 3.0)]
    assert [(s.labels, s.value) for s in families["tern_num_requests_running"].samples] == [({"replica": "r2"}, 1.0)]
