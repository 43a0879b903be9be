"""How long a first start takes: `python app.py` with empty caches (no converted model, no built kernels, no
inductor cache), timed from launch to /health 200 and to the first chat answer, then a second start on the caches
the first one left.

    .venv/bin/python bench/first_start.py [--args "--quantization int8"]

The server listens on 127.0.0.1 only and is stopped after each start.
"""
from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def timed_start(args: list[str], env: dict) -> tuple[float, float, dict]:
    """(seconds to /health 200, seconds to the first answer, /v1/models' card) for one start."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--host", "127.0.0.1", "--port", str(port), *args],
                               cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if process.poll() is not None:
                raise SystemExit(f"the server exited with {process.returncode}")
            if time.monotonic() - started > 900:
                raise SystemExit("not healthy after 900 s")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        healthy = time.monotonic() - started
        card = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]
        body = {"model": card["id"], "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 20, "temperature": 0}
        httpx.post(f"{base}/v1/chat/completions", json=body, timeout=600).raise_for_status()
        return healthy, time.monotonic() - started, card
    finally:
        process.terminate()
        process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--args", default="", help="extra app.py flags")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tern-first-start-") as tmp:
        env = {**os.environ, "TERN_CACHE": f"{tmp}/cache", "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor"}
        for label in ("first start (empty caches)", "second start"):
            healthy, answered, card = timed_start(shlex.split(args.args), env)
            print(f"{label}: /health 200 after {healthy:.1f} s, first answer after {answered:.1f} s "
                  f"({card['quantization']}, decode step {card['decode_step']}, {card['cpu_kernels']})")


if __name__ == "__main__":
    main()
