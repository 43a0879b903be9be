"""Graceful shutdown of the real server: on SIGTERM (or SIGINT) running streams finish intact, new requests get
503 with Retry-After while it drains, what outlives --drain-timeout ends with a finish_reason and [DONE], and the
process exits 0. Each test starts its own server, since each ends it."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import time

import httpx
import pytest

from conftest import start_server, wait_healthy

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# Exact answers: fp32 and unquantized, as the other servers that compare texts; no compile, so it starts in seconds.
SERVER_ARGS = ("--dtype", "float32", "--quantization", "none", "--no-compile")
QUESTIONS = ["What is the capital of France?", "Name three birds.", "What is 2 + 2?", "Say hello politely.",
             "Name a primary color.", "What is the largest ocean?", "Count to five.", "What do bees make?"]


def body(question: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": 32,
            "ignore_eos": True, **fields}


def wait_exit(process: subprocess.Popen, timeout_s: float) -> int:
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
        raise AssertionError(f"the server did not exit within {timeout_s} s of the signal")


async def read_stream(client: httpx.AsyncClient, request: dict, started: asyncio.Event,
                      num_started: list[int], num_streams: int) -> list[str]:
    """The data lines of one stream; `started` is set once every stream has had a content delta."""
    lines = []
    async with client.stream("POST", CHAT, json={**request, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line:
                continue
            lines.append(line)
            if len(lines) == 2:  # the role delta, then the first content delta: this one is decoding
                num_started[0] += 1
                if num_started[0] == num_streams:
                    started.set()
    return lines


def text_and_finishes(lines: list[str]) -> tuple[str, list[str]]:
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all("error" not in chunk for chunk in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert chunks[-1]["choices"][0]["finish_reason"] is not None  # the last chunk says how it ended
    return text, finishes


def test_sigterm_lets_8_running_streams_finish_intact_and_exits_0():
    # A drain timeout far above what 8 x 32 tokens take even on a busy 2-core machine: nothing should be cut.
    process, base_url, log_path = start_server(*SERVER_ARGS, "--drain-timeout", "300", log_name="drain-server")
    try:
        wait_healthy(process, base_url, log_path)
        async def answers() -> list[str]:  # the same requests, not streamed: all at once, as the streams will run
            async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
                replies = await asyncio.gather(*(client.post(CHAT, json=body(q)) for q in QUESTIONS))
            return [reply.json()["choices"][0]["message"]["content"] for reply in replies]

        expected = asyncio.run(answers())

        async def run() -> list[list[str]]:
            started = asyncio.Event()
            num_started = [0]
            limits = httpx.Limits(max_connections=len(QUESTIONS))
            async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
                streams = [asyncio.create_task(read_stream(client, body(q), started, num_started, len(QUESTIONS)))
                           for q in QUESTIONS]
                await asyncio.wait_for(started.wait(), timeout=300)
                process.send_signal(signal.SIGTERM)  # all 8 are decoding
                return await asyncio.gather(*streams)

        results = asyncio.run(run())
        for lines, want in zip(results, expected):
            text, finishes = text_and_finishes(lines)
            assert finishes == ["length"] and text == want
        assert wait_exit(process, 120) == 0
        assert "drained: every request finished" in log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def test_after_the_drain_timeout_a_long_stream_ends_with_a_finish_reason_and_done():
    process, base_url, log_path = start_server(*SERVER_ARGS, "--drain-timeout", "4", log_name="drain-timeout-server")
    try:
        wait_healthy(process, base_url, log_path)
        endless = body("Write a very long story about a dragon.", max_tokens=4000)
        with httpx.Client(base_url=base_url, timeout=120) as client:
            with client.stream("POST", CHAT, json={**endless, "stream": True}) as response:
                lines = (line for line in response.iter_lines() if line)
                received = [next(lines), next(lines)]  # the role delta and the first content delta: decoding now
                process.send_signal(signal.SIGINT)  # Ctrl+C drains too

                deadline = time.monotonic() + 3  # a bounded poll: the drain begins within a tick
                while (ready := client.get("/ready")).status_code == 200:
                    assert time.monotonic() < deadline, "still ready after the signal"
                    time.sleep(0.05)
                assert ready.status_code == 503 and ready.json()["error"]["code"] == "server_shutting_down"
                assert client.get("/health").json()["status"] == "draining"  # alive: no probe should kill it

                refused = client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 1})
                assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
                error = refused.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert error["type"] == "service_unavailable_error" and "shutting down" in error["message"]

                received += list(lines)
        text, finishes = text_and_finishes(received)
        assert finishes == ["abort"] and text  # it had produced text, and it says it was cut short
        assert wait_exit(process, 60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def test_a_plain_request_still_running_at_the_drain_timeout_gets_a_503():
    process, base_url, log_path = start_server(*SERVER_ARGS, "--drain-timeout", "1", log_name="drain-plain-server")
    try:
        wait_healthy(process, base_url, log_path)

        async def run() -> httpx.Response:
            async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
                request = asyncio.create_task(client.post(CHAT, json=body("Tell me a long story.", max_tokens=4000)))
                deadline = time.monotonic() + 60
                while not re.search(r"^tern_num_requests_running\{.*\} 1\.0$", (await client.get("/metrics")).text,
                                    re.MULTILINE):
                    assert time.monotonic() < deadline and not request.done()
                    await asyncio.sleep(0.1)
                process.send_signal(signal.SIGTERM)
                return await request

        response = asyncio.run(run())
        assert response.status_code == 503 and int(response.headers["retry-after"]) >= 1
        assert response.json()["error"]["code"] == "server_shutting_down"
        assert wait_exit(process, 60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def test_sigterm_drains_every_model_each_stream_finishes_and_new_requests_for_any_model_get_503(tiny_checkpoint):
    """Several models: one drain covers them all. A stream on each model runs to its end, a new request for either
    model is refused once the drain has begun, and the process exits 0 when both engines are idle."""
    from engine.weights.checkpoint import default_gguf_path

    process, base_url, log_path = start_server(*SERVER_ARGS, "--model", str(default_gguf_path()), "--model",
                                               str(tiny_checkpoint), "--drain-timeout", "300",
                                               log_name="drain-models-server")
    try:
        wait_healthy(process, base_url, log_path)
        ids = [card["id"] for card in httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"]]
        assert len(ids) == 2
        # Long enough that neither ends before the signal: the tiny model decodes fast, so it is asked for more.
        requests = [body("Tell me a long story.", model=ids[0], max_tokens=48),
                    body("Tell me a long story.", model=ids[1], max_tokens=1500)]

        async def run() -> tuple[list[list[str]], list[httpx.Response]]:
            started, num_started = asyncio.Event(), [0]
            async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
                streams = [asyncio.create_task(read_stream(client, r, started, num_started, len(requests)))
                           for r in requests]
                await asyncio.wait_for(started.wait(), timeout=300)
                process.send_signal(signal.SIGTERM)  # both models are decoding
                deadline = time.monotonic() + 3  # a bounded poll: the drain begins within a tick
                while (await client.get("/ready")).status_code == 200:
                    assert time.monotonic() < deadline, "still ready after the signal"
                    await asyncio.sleep(0.05)
                refused = [await client.post(COMPLETIONS, json={"model": i, "prompt": "hi", "max_tokens": 1})
                           for i in ids]
                return await asyncio.gather(*streams), refused

        results, refused = asyncio.run(run())
        for lines, request in zip(results, requests):
            text, finishes = text_and_finishes(lines)
            assert finishes == ["length"] and text, request["model"]
        assert [r.status_code for r in refused] == [503, 503]
        assert all(r.json()["error"]["code"] == "server_shutting_down" for r in refused)
        assert wait_exit(process, 120) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
