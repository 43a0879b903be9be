"""Ready means fast: per configuration, seconds from launch to /health 200, the decode rate of the first request
sent at that moment, and the rate of the same request a while later (the steady state), with empty and with warm
caches. The requirement (issue 30): the first request at >= 90% of the steady rate.

    .venv/bin/python bench/ready_speed.py --rounds 2 [--steady-after-s 60] \
        --config "" --config "--model /work/models/llama1b/model-Q4_0.gguf" --config "--dtype bfloat16"

A configuration is app.py's flags ("" is `make run`'s default). Empty caches: a fresh TERN_CACHE and inductor cache
folder per start (the kernels are built, the GGUF read, the step compiled, as on a machine's first start); warm: the
user's caches, primed by one untimed start. Each round starts every configuration once per cache state, in an order
reversed every other round. The request: a ~100-token prompt, 128 tokens, ignore_eos, greedy, streamed; its rate
is (tokens - 1) / (last token - first token), so the prefill is not in it. Which step served is read from
/v1/models and /metrics (tern_decode_steps_total). 127.0.0.1 only.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf_servers import free_port, stop_process  # noqa: E402
from rounds import _cpu_flags  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPT = " ".join(["The history of the city goes back to a small village on the river, and"] * 7)


def decode_rate(base: str, model: str, tokens: int) -> float:
    """Tokens per second of one streamed completion, from its first token to its last."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    stamps = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0]["text"] or not stamps:
                    stamps.append(time.perf_counter())
    return (tokens - 1) / (stamps[-1] - stamps[0])


def decode_steps(base: str) -> dict[str, int]:
    return {line.split('"')[1]: int(float(line.split(" ")[1]))
            for line in httpx.get(f"{base}/metrics").text.splitlines() if line.startswith("tern_decode_steps_total{")}


def one_start(flags: list[str], env: dict, steady_after_s: float, tokens: int) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--host", "127.0.0.1", "--port", str(port),
                                *flags], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if process.poll() is not None:
                raise SystemExit(f"app.py {' '.join(flags)} exited with {process.returncode}")
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - started > 1800:
                raise SystemExit(f"app.py {' '.join(flags)}: not ready after 1800 s")
            time.sleep(0.05)
        ready_s = time.perf_counter() - started
        card = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]
        first = decode_rate(base, card["id"], tokens)
        first_steps = decode_steps(base)
        time.sleep(max(0.0, steady_after_s - (time.perf_counter() - started - ready_s)))
        steady = statistics.median(decode_rate(base, card["id"], tokens) for _ in range(3))
        return {"ready_s": ready_s, "first": first, "steady": steady, "step": card["decode_step"],
                "first_steps": first_steps}
    finally:
        stop_process(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", default=None, help="app.py flags, quoted (repeatable)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steady-after-s", type=float, default=60.0, help="when the steady rate is measured")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--caches", default="empty,warm")
    args = parser.parse_args()
    configs = args.config or [""]
    caches = args.caches.split(",")
    flags = " ".join(sorted(f for f in _cpu_flags() if f == "avx2" or f.startswith("avx512")))
    print(f"CPU: {flags}; {os.cpu_count()} cores; {args.rounds} rounds, alternated; steady = median of 3 requests "
          f"{args.steady_after_s:.0f} s after ready")
    if "warm" in caches:
        for config in configs:  # primes the user's caches: not timed
            one_start(shlex.split(config), dict(os.environ), 0, 8)
    results: dict[tuple[str, str], list[dict]] = {}
    runs = [(config, cache) for config in configs for cache in caches]
    for round_index in range(args.rounds):
        for config, cache in runs if round_index % 2 == 0 else runs[::-1]:
            env = dict(os.environ)
            with tempfile.TemporaryDirectory(prefix="tern-ready-") as tmp:
                if cache == "empty":
                    env.update(TERN_CACHE=f"{tmp}/cache", TORCHINDUCTOR_CACHE_DIR=f"{tmp}/inductor")
                result = one_start(shlex.split(config), env, args.steady_after_s, args.tokens)
            results.setdefault((config, cache), []).append(result)
            print(f"  round {round_index + 1} {config or '(default)'} [{cache}]: {result}", flush=True)
    print("\n| configuration | caches | decode step | ready s | first request tok/s | steady tok/s | first / steady |")
    print("|---|---|---|---|---|---|---|")
    for (config, cache), rows in results.items():
        def median(key):
            return statistics.median(r[key] for r in rows)
        ratios = [r["first"] / r["steady"] for r in rows]
        steps = "/".join(sorted({r["step"] for r in rows}))
        print(f"| {config or '(default)'} | {cache} | {steps} | {median('ready_s'):.1f} | {median('first'):.1f} | "
              f"{median('steady'):.1f} | {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |")


if __name__ == "__main__":
    main()
