"""Many clients at once, clients that leave, a full queue and a model that is not there: every text is
right, no request is left running, a full queue answers 429 with Retry-After, no model 503 (tests/e2e/test_api_key.py has the key), and
the server keeps serving. Every wait is a bounded poll of /metrics."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import start_server, stop_server, wait_healthy

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# A request that would run for minutes unless it is aborted.
ENDLESS = {"messages": QUESTION, "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
API_KEY = "tern-test-key-5c1e9a"


def engine_load(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    names = {"tern_num_requests_running", "tern_num_requests_waiting", "tern_kv_cache_blocks_used"}
    return {f.name: f.samples[0].value for f in text_string_to_metric_families(text) if f.name in names}


def wait_until(predicate, what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"still not {what} after {timeout_s} s"
        time.sleep(0.1)


def wait_idle(base_url: str) -> None:
    """Nothing running or waiting, and every KV block free again."""
    wait_until(lambda: not any(engine_load(base_url).values()), "idle")


def content_chunks(lines):
    """The content deltas of a chat stream, one by one, as they arrive."""
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            delta = json.loads(line[len("data: ") :])["choices"][0]["delta"]
            if delta.get("content"):
                yield delta["content"]


def test_16_concurrent_streaming_clients_all_get_their_text(live_server):
    prompts = ["What is the capital of France?", "What is 2 + 2?", "Name a primary color.", "Say hello politely."]
    bodies = [{"messages": [{"role": "user", "content": p}], "max_tokens": 16, "temperature": 0} for p in prompts]
    with httpx.Client(base_url=live_server, timeout=300) as client:
        expected = [client.post(CHAT, json=body).json()["choices"][0]["message"]["content"] for body in bodies]

    async def stream(client: httpx.AsyncClient, body: dict) -> str:
        async with client.stream("POST", CHAT, json={**body, "stream": True}) as response:
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
        assert len({chunk["id"] for chunk in chunks}) == 1
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] in (["stop"], ["length"])
        return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(base_url=live_server, timeout=300, limits=limits) as client:
            return await asyncio.gather(*(stream(client, bodies[i % 4]) for i in range(16)))

    texts = asyncio.run(run())
    assert texts == [expected[i % 4] for i in range(16)]
    wait_idle(live_server)


def test_a_client_leaving_mid_stream_leaves_nothing_running(live_server):
    wait_idle(live_server)
    with httpx.stream("POST", f"{live_server}{CHAT}", json={**ENDLESS, "stream": True}, timeout=120) as response:
        received = content_chunks(response.iter_lines())
        for _ in range(3):
            next(received)
        assert engine_load(live_server)["tern_num_requests_running"] == 1
    # The connection is closed: the engine aborts the request and frees its KV blocks.
    wait_idle(live_server)


def test_a_client_leaving_before_a_plain_answer_leaves_nothing_running(live_server):
    """Starlette cancels only streaming responses by itself; a plain one is watched for the disconnect."""
    wait_idle(live_server)

    async def run() -> None:
        async with httpx.AsyncClient(base_url=live_server, timeout=120) as client:
            request = asyncio.create_task(client.post(CHAT, json=ENDLESS))
            deadline = time.monotonic() + 90
            while engine_load(live_server)["tern_num_requests_running"] < 1:
                assert time.monotonic() < deadline and not request.done()
                await asyncio.sleep(0.1)
            request.cancel()  # httpx closes the connection
            with contextlib.suppress(asyncio.CancelledError):
                await request

    asyncio.run(run())
    wait_idle(live_server)
    answer = httpx.post(f"{live_server}{COMPLETIONS}", json={"prompt": "The capital of France is", "max_tokens": 2,
                                                              "temperature": 0}, timeout=120)
    assert answer.json()["choices"][0]["text"] == " Paris."


@pytest.fixture(scope="module")
def guarded_server():
    """Its own server: an API key, one sequence at a time and room for one waiting request."""
    process, base_url, log_path = start_server(
        "--dtype", "float32", "--quantization", "none", "--max-num-seqs", "1", "--max-waiting", "1", "--no-compile",
        env={"TERN_API_KEY": API_KEY},
        log_name="guarded-server",
    )
    try:
        wait_healthy(process, base_url, log_path)
        yield base_url, log_path
    finally:
        stop_server(process)


def test_a_full_queue_answers_429_with_retry_after_then_recovers(guarded_server):
    base_url, _ = guarded_server
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=base_url, headers=auth, timeout=120) as client:
        wait_idle(base_url)
        with client.stream("POST", CHAT, json={**ENDLESS, "stream": True}) as running:
            running_chunks = content_chunks(running.iter_lines())  # kept: closing it would close the response
            next(running_chunks)  # decoding: it holds the one slot
            with client.stream("POST", CHAT, json={**ENDLESS, "stream": True}) as waiting:
                assert waiting.status_code == 200  # accepted: it waits for the slot
                wait_until(lambda: engine_load(base_url)["tern_num_requests_waiting"] == 1, "waiting")
                assert engine_load(base_url)["tern_num_requests_running"] == 1
                assert client.get("/ready").status_code == 503  # load balancers: send no more here

                refused = client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 1})
                assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
                assert refused.json()["error"]["type"] == "rate_limit_error"
                sdk = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
                with pytest.raises(openai.RateLimitError):
                    sdk.completions.create(model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=1)
        wait_idle(base_url)  # both clients are gone: both requests were aborted
        assert client.get("/ready").status_code == 200
        answer = client.post(COMPLETIONS, json={"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0})
        assert answer.json()["choices"][0]["text"] == " Paris."


def test_health_answers_503_while_the_model_loads_and_200_once_it_serves():
    """The model loads while the web app is built (app.py): from the first answer on, /health says 503 \"still
    loading\" until the engine serves, and the first 200 means a request is answered at once."""
    # Float weights de-quantized from the file load slower than the app is built: a 503 window is likely, not needed.
    process, base_url, log_path = start_server("--quantization", "none", "--dtype", "float32", "--no-compile",
                                               log_name="loading-server")
    try:
        statuses = []
        deadline = time.monotonic() + 300
        with httpx.Client(base_url=base_url, timeout=30) as client:
            while not statuses or statuses[-1] != 200:
                assert process.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, log_path.read_text()[-3000:]
                with contextlib.suppress(httpx.TransportError):  # not listening yet
                    health = client.get("/health")
                    statuses.append(health.status_code)
                    if health.status_code != 200:
                        assert health.status_code == 503 and health.headers["retry-after"], health.text
                        assert health.json()["error"]["code"] == "model_not_ready", health.text
                        assert "still loading" in health.json()["error"]["message"]
                time.sleep(0.02)
            assert "engine ready" in log_path.read_text()
            assert client.get("/ready").status_code == 200
            answer = client.post(COMPLETIONS, json={"prompt": "The capital of France is", "max_tokens": 2,
                                                    "temperature": 0})
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"]
            assert client.get("/").status_code == 200  # the UI is mounted by then too
    finally:
        stop_server(process)


def test_without_a_model_every_route_answers_503_in_openais_shape(tmp_path):
    """A checkpoint that cannot load stands in for one still loading: both leave the engine absent."""
    (tmp_path / "config.json").write_text("{}")
    process, base_url, log_path = start_server("--model", str(tmp_path), log_name="no-model-server")
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                health = httpx.get(f"{base_url}/health", timeout=5)
                if "failed to load" in health.text:
                    break
            time.sleep(0.25)
        assert health.status_code == 503 and health.headers["retry-after"]
        assert health.json()["error"]["type"] == "service_unavailable_error"
        for method, path, body in [("POST", CHAT, {"messages": QUESTION}), ("POST", COMPLETIONS, {"prompt": "hi"}),
                                   ("GET", "/v1/models", None), ("GET", "/ready", None)]:
            response = httpx.request(method, f"{base_url}{path}", json=body, timeout=30)
            assert response.status_code == 503, path
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        with pytest.raises(openai.InternalServerError):  # the SDK would retry this one: the model may yet come
            openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0).models.list()
    finally:
        stop_server(process)
