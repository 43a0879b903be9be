"""`make run` as a new user meets it: the server with no flags and an empty cache reads the model's blocks, builds the
CPU kernels and answers at once: with the native decode step where it serves (int4/int8 in fp32 on a kernel path),
else with the eager step while the compiled one builds, then compiled. The quantization `auto` chose, the kernel
path and the decode step are on /v1/models and in the log."""
from __future__ import annotations

import time

import httpx
import pytest
from conftest import start_server, stop_server, wait_healthy

from engine import kernels

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _card(base_url: str) -> dict:
    return httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]


def test_a_first_start_answers_while_compiling_then_runs_compiled(tmp_path):
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
        # Nothing to compile where the native step serves; elsewhere a cold compile takes minutes and nobody
        # waits for it.
        native = path != "off" and card["dtype"] == "float32"
        assert card["decode_step"] == ("native" if native else "compiling")
        body = {"model": card["id"], "messages": QUESTION, "max_tokens": 12, "temperature": 0}
        during = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=300).json()
        assert during["usage"]["completion_tokens"] >= 1 and during["choices"][0]["message"]["content"]
        deadline = time.monotonic() + 900
        while _card(base_url)["decode_step"] == "compiling" and time.monotonic() < deadline:
            time.sleep(2)
        assert _card(base_url)["decode_step"] == ("native" if native else "compiled")
        after = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=300).json()
        assert after["choices"][0]["message"]["content"]
        log = log_path.read_text()
        assert f"CPU kernels: {path} (" in log and "building Tern's CPU kernels" in log
        assert (cache / "kernels").is_dir() and list((cache / "kernels").glob("tern_kernels-*.so"))
    finally:
        stop_server(process)
