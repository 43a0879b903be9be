"""`python -m deploy.ray_serve` as a user runs it (a local Ray cluster of its own, 2 replicas of a tiny model), and
SIGTERM: new requests get 503 in OpenAI's shape while a running stream finishes, then the process exits 0."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import ARTIFACTS, ROOT, free_port

pytestmark = pytest.mark.slow
pytest.importorskip("ray.serve", reason="Ray is not installed: pip install -r requirements-ray.txt")


def test_the_command_serves_then_drains_on_sigterm_and_exits_0(tiny_checkpoint):
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    ARTIFACTS.mkdir(exist_ok=True)
    log_path = ARTIFACTS / f"ray-serve-cli-{port}.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "deploy.ray_serve", "--ray-address", "local", "--replicas", "2", "--num-cpus", "0.5",
             "--model", str(tiny_checkpoint), "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
             "--no-compile", "--drain-timeout", "60"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"{base_url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert httpx.get(f"{base_url}/v1/models", timeout=5).status_code == 200, log_path.read_text()[-3000:]

        events: list[str] = []
        first_chunk = threading.Event()

        def stream() -> None:
            # Nearly the whole context (4,096 positions), so that the stream outlasts the drain order's way from the
            # signal to every replica (a report period) even where the tiny model decodes fast: 1,000 tokens ended
            # before the first 503 on CI once.
            body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about terns."}],
                    "max_tokens": 3900, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                        first_chunk.set()

        running = threading.Thread(target=stream)
        running.start()
        assert first_chunk.wait(60)
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        refused = None
        while time.monotonic() < deadline:
            response = httpx.post(f"{base_url}/v1/completions", json={"model": "tiny", "prompt": "A", "max_tokens": 1},
                                  timeout=30)
            if response.status_code == 503:
                refused = response
                break
            time.sleep(0.2)
        assert refused is not None and refused.json()["error"]["code"] == "server_shutting_down"
        assert int(refused.headers["retry-after"]) >= 1
        assert httpx.get(f"{base_url}/ready", timeout=10).status_code == 503
        assert running.is_alive()  # still streaming while new requests are refused
        running.join(120)
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"  # ran to its end, not cut
        assert process.wait(90) == 0, log_path.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
