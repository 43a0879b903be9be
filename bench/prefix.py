"""Prefix caching seen from a client: time to first token for a request that shares a long system prompt with
an earlier one, against the first request's (same run, ratio).

    .venv/bin/python bench/prefix.py --base-url http://127.0.0.1:7860/v1 [--system-tokens 1000] [--pairs 3]

Each pair uses a fresh system prompt (so the first request of a pair is uncached) followed by a second request
with the same system prompt and a different question.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import seeded_prompt  # noqa: E402


def ttft(client: httpx.Client, model: str, system: str, question: str) -> float:
    body = {"model": model, "stream": True, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    start = time.perf_counter()
    with client.stream("POST", "/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                return time.perf_counter() - start
    raise RuntimeError("no content streamed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:7860/v1")
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    with httpx.Client(base_url=args.base_url, timeout=300) as client:
        model = client.get("/models").json()["data"][0]["id"]
        firsts, seconds = [], []
        for pair in range(args.pairs):
            system = seeded_prompt(1000 + pair, args.system_tokens)
            firsts.append(ttft(client, model, system, "Summarize the story in one sentence."))
            seconds.append(ttft(client, model, system, "Who is the main character?"))
    first, second = statistics.median(firsts), statistics.median(seconds)
    print(f"~{args.system_tokens}-token system prompt, median of {args.pairs} pairs: TTFT first {first:.2f} s, "
          f"second (shared prefix) {second:.2f} s, ratio {second / first:.0%}")


if __name__ == "__main__":
    main()
