"""`make run` as a new user meets it: the server with no flags and an empty cache reads the model's blocks, builds the
CPU kernels and, once /health says ready, decodes at full speed from the first request: with the native step where
it serves (int4/int8 in fp32 on a kernel path), else with the compiled step, built before ready. The quantization
`auto` chose, the kernel path and the decode step are on /v1/models, /metrics and in the log."""
from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from conftest import start_server, stop_server, wait_healthy

from engine import kernels

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _card(base_url: str) -> dict:
    return httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]


def _decode_steps(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics").text
    return {s.labels["step"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "tern_decode_steps_total"}


def test_a_first_start_serves_its_first_request_on_the_full_speed_step(tmp_path):
    cache = tmp_path / "cache"
    process, base_url, log_path = start_server(
        env={"TERN_CACHE": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}, log_name="first-start")
    try:
        wait_healthy(process, base_url, log_path, timeout_s=600)
        card = _card(base_url)
        path, _ = kernels.planned_path()
        assert card["cpu_kernels"].startswith(f"{path} (")
        # auto: the file's 4-bit blocks stay 4-bit on every path (its one Q8_0 tensor, the embedding, is int8).
        assert card["quantization"] == "int4"
        # Nothing to compile where the native step serves; elsewhere the compiled step is built before ready.
        native = path != "off" and card["dtype"] == "float32"
        step = "native" if native else "compiled"
        assert card["decode_step"] == step and _decode_steps(base_url) == {}
        body = {"model": card["id"], "messages": QUESTION, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        first = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=300).json()
        assert first["usage"]["completion_tokens"] == 12 and first["choices"][0]["message"]["content"]
        assert _decode_steps(base_url) == {step: 11}  # the first token comes from the prefill
        log = log_path.read_text()
        assert f"CPU kernels: {path} (" in log and "building Tern's CPU kernels" in log
        assert (cache / "kernels").is_dir() and list((cache / "kernels").glob("tern_kernels-*.so"))
    finally:
        stop_server(process)


def _gc_collections(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return {s.labels["generation"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "python_gc_collections_total"}


def test_a_start_makes_no_full_garbage_collection_and_serving_collects_again():
    """Started as a server, Python's collector stays off while the app is built (full collections over the web
    app's objects took 0.6 s of a start): /metrics shows no full (generation 2) collection at ready; once serving,
    the collector is on again, so collections go on as requests create objects."""
    process, base_url, log_path = start_server(log_name="gc-pause")
    try:
        wait_healthy(process, base_url, log_path)
        at_ready = _gc_collections(base_url)
        assert at_ready["2"] == 0
        for _ in range(40):  # bounded: a collection comes within a few requests' objects
            response = httpx.post(f"{base_url}/v1/chat/completions", timeout=120,
                                  json={"messages": QUESTION, "max_tokens": 16})
            assert response.status_code == 200
            if _gc_collections(base_url)["0"] > at_ready["0"]:
                break
        assert _gc_collections(base_url)["0"] > at_ready["0"]
        assert process.poll() is None
    finally:
        stop_server(process)
