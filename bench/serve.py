"""Load generator for any OpenAI-compatible server: a concurrency sweep of streaming chat requests.

    .venv/bin/python bench/serve.py --base-url http://127.0.0.1:7860/v1 --concurrency 1 4 16 \
        --prompt-tokens 100 --max-tokens 128 [--requests-per-level 2x] [--json out.json]

Each level runs `concurrency` clients that each send requests back to back until the level has sent its quota
(by default twice the concurrency, at least 4). Prompts are cut from a fixed seeded text to about
--prompt-tokens tokens (counted by the server's own usage numbers), a different one for every request of the
sweep, so a prefix cache cannot carry one level over to the next. Every request asks for exactly --max-tokens
tokens (`ignore_eos` and `min_tokens`, which Tern and vLLM honour and other servers ignore;
--openai-fields-only leaves them out for servers that refuse them, transformers serve among them).

--intruder-tokens 2000 repeats each level with one ~2,000-token prompt arriving mid-decode (the chunked
prefill check: the other streams' inter-token latency should barely move).

Per level: aggregate output tokens/s, requests/s, time to first token p50/p95, inter-token latency p50/p95,
decode tokens/s per stream (after the first token), errors. Markdown table on stdout; --json writes the same.
Only point it at servers you run yourself (127.0.0.1 in our tests and notes).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

WORDS = (
    "the river carried small boats past the old mill while children counted clouds above the quiet valley and "
    "a baker opened his shop before dawn to sell warm bread to travellers who had walked all night across the hills"
).split()


def seeded_prompt(index: int, approx_tokens: int) -> str:
    """A different but reproducible prompt per request, about approx_tokens tokens long (~1.3 tokens per word)."""
    rng = random.Random(index)
    words = [rng.choice(WORDS) for _ in range(max(1, int(approx_tokens / 1.3)))]
    return f"Request {index}. Continue this story: " + " ".join(words)


@dataclass
class RequestResult:
    ok: bool
    start: float
    first_token: float | None = None
    end: float | None = None
    token_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


async def one_request(client: httpx.AsyncClient, args, index: int, prompt_tokens: int | None = None,
                      max_tokens: int | None = None) -> RequestResult:
    """One streamed request. Sent once more if the server dropped the connection before answering anything: a
    keep-alive connection it had closed while idle (llama-server does), which a browser or SDK retries too."""
    result = await _one_request(client, args, index, prompt_tokens, max_tokens)
    if not result.ok and result.first_token is None and "RemoteProtocolError" in result.error:
        result = await _one_request(client, args, index, prompt_tokens, max_tokens)
    return result


async def _one_request(client: httpx.AsyncClient, args, index: int, prompt_tokens: int | None,
                       max_tokens: int | None) -> RequestResult:
    max_tokens = max_tokens or args.max_tokens
    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": seeded_prompt(index, prompt_tokens or args.prompt_tokens)}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if not args.openai_fields_only:
        body.update(ignore_eos=True, min_tokens=max_tokens)
    result = RequestResult(ok=False, start=time.perf_counter())
    try:
        async with client.stream("POST", "/chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.completion_tokens = chunk["usage"]["completion_tokens"]
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                for choice in chunk.get("choices", []):
                    if choice.get("delta", {}).get("content"):
                        now = time.perf_counter()
                        result.first_token = result.first_token or now
                        result.token_times.append(now)
        result.end = time.perf_counter()
        result.ok = result.first_token is not None
        result.completion_tokens = result.completion_tokens or len(result.token_times)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = repr(exc)
    return result


def level_quota(args, concurrency: int) -> int:
    return args.requests_per_level or max(4, 2 * concurrency)


async def run_level(args, concurrency: int, first_index: int, intruder_tokens: int = 0) -> dict:
    """Requests first_index, first_index + 1, ... (and the intruder the next one): no two requests of a sweep
    share a prompt, so a server's prefix cache never serves one level from an earlier level's prompts."""
    quota = level_quota(args, concurrency)
    counter = iter(range(first_index, first_index + quota))
    results: list[RequestResult] = []
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=args.timeout, limits=limits) as client:

        async def worker() -> None:
            for index in counter:
                results.append(await one_request(client, args, index))

        async def intruder() -> None:
            # One long prompt lands while the others decode: chunked prefill should keep their pace steady.
            await asyncio.sleep(args.intruder_delay)
            await one_request(client, args, first_index + quota, prompt_tokens=intruder_tokens, max_tokens=1)

        start = time.perf_counter()
        extra = [intruder()] if intruder_tokens else []
        await asyncio.gather(*(worker() for _ in range(concurrency)), *extra)
        wall = time.perf_counter() - start
    row = summarize(concurrency, results, wall)
    row["intruder_tokens"] = intruder_tokens
    return row


def summarize(concurrency: int, results: list[RequestResult], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.first_token - r.start for r in ok]
    itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    per_stream = [
        (r.completion_tokens - 1) / (r.end - r.first_token) for r in ok if r.end > r.first_token and r.completion_tokens > 1
    ]
    total_tokens = sum(r.completion_tokens for r in ok)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if not r.ok), ""),
        "output_tok_s": total_tokens / wall,
        "requests_s": len(ok) / wall,
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p95_s": _pct(ttft, 95),
        "itl_p50_ms": 1000 * _pct(itl, 50),
        "itl_p95_ms": 1000 * _pct(itl, 95),
        "stream_decode_tok_s": statistics.median(per_stream) if per_stream else float("nan"),
        "mean_prompt_tokens": statistics.mean(r.prompt_tokens for r in ok) if ok else float("nan"),
    }


def _pct(values: list[float], pct: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(pct / 100 * (len(values) - 1))))]


def print_table(rows: list[dict]) -> None:
    print("| concurrency | requests | errors | output tok/s | req/s | TTFT p50 s | TTFT p95 s | ITL p50 ms "
          "| ITL p95 ms | per-stream tok/s | prompt tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        label = f"{r['concurrency']} + one {r['intruder_tokens']}-token prompt" if r["intruder_tokens"] else r["concurrency"]
        print(f"| {label} | {r['requests']} | {r['errors']} | {r['output_tok_s']:.1f} | {r['requests_s']:.2f} "
              f"| {r['ttft_p50_s']:.2f} | {r['ttft_p95_s']:.2f} | {r['itl_p50_ms']:.1f} | {r['itl_p95_ms']:.1f} "
              f"| {r['stream_decode_tok_s']:.1f} | {r['mean_prompt_tokens']:.0f} |")
    for r in rows:
        if r["errors"]:
            print(f"concurrency {r['concurrency']}: first error: {r['first_error']}")


async def main_async(args) -> list[dict]:
    if not args.model:
        async with httpx.AsyncClient(base_url=args.base_url, timeout=30) as client:
            headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            args.model = (await client.get("/models", headers=headers)).json()["data"][0]["id"]
    rows, next_index = [], 0
    for concurrency in args.concurrency:
        for intruder_tokens in (0, args.intruder_tokens) if args.intruder_tokens else (0,):
            rows.append(await run_level(args, concurrency, next_index, intruder_tokens))
            next_index += level_quota(args, concurrency) + 1
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:7860/v1")
    parser.add_argument("--model", help="model id to send (default: the first one /v1/models lists)")
    parser.add_argument("--api-key")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests-per-level", type=int, help="default: twice the concurrency, at least 4")
    parser.add_argument("--intruder-tokens", type=int, default=0,
                        help="also run each level with one prompt of about this many tokens arriving mid-decode")
    parser.add_argument("--intruder-delay", type=float, default=3.0, help="seconds into the level it arrives")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--openai-fields-only", action="store_true",
                        help="send no ignore_eos/min_tokens, for servers that refuse unknown fields (transformers "
                        "serve): answers may then end before --max-tokens, and the figures count what came")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = asyncio.run(main_async(args))
    print(f"\n{args.base_url} model {args.model}, ~{args.prompt_tokens} prompt tokens, {args.max_tokens} output tokens, "
          f"streaming chat\n")
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
