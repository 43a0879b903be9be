"""Prefix affinity on Ray Serve: the prefix-cache hit rate, summed over the replicas, of multi-turn chats routed by
Tern's prefix-aware router against Ray's default power-of-two-choices router, measured in one run.

    .venv/bin/python bench/ray_affinity.py                       # the default model, 2 replicas on this machine
    .venv/bin/python bench/ray_affinity.py --model /tmp/tern-tiny # a random tiny checkpoint (random_checkpoint.py)

Each router gets its own deployment (fresh replicas, empty caches) and its own conversations: N conversations of
T turns, interleaved (turn 1 of every conversation at once, then turn 2, ...), each with a system prompt of its own,
so a conversation can find its prefix only where its earlier turns ran. Hit rate: KV blocks reused from the prefix
cache (tern_prefix_cache_hits, every replica's, from /metrics) over the full blocks of every prompt sent.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 16  # the engine's KV block size (EngineConfig.block_size)
_WORDS = ("tern gull wing shore tide salt wind reef dune cliff storm harbour pebble kelp current plover sand "
          "heron estuary lagoon marsh spray gale beacon mooring sail anchor driftwood lighthouse").split()


@dataclass
class Result:
    router: str
    hit_blocks: int
    prompt_blocks: int
    requests: int
    seconds: float
    replicas_used: int
    num_conversations_on_one_replica: int  # conversations whose every turn ran on the same replica
    ideal_blocks: int  # the most that could hit: each turn's blocks of the turn before (its prompt and answer)

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0


def text(seed: int, num_words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(num_words)).capitalize() + "."


async def run_conversations(base_url: str, num_conversations: int = 8, num_turns: int = 4, max_tokens: int = 16,
                            seed: int = 0, api_key: str = "unused") -> tuple[int, int, list[list[str]], int]:
    """Send the conversations, interleaved; returns (prompt blocks sent, hit blocks added, for each conversation
    the replicas that answered its turns, the most blocks that could have hit)."""
    headers = {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(base_url=base_url, timeout=600, headers=headers) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        before = await prefix_cache_hits(client)
        chats = [[{"role": "system", "content": f"Conversation {seed}-{c}. " + text(seed * 1000 + c, 12)}]
                 for c in range(num_conversations)]
        prompt_blocks, ideal_blocks, replicas = 0, 0, [[] for _ in chats]
        previous = [0] * len(chats)  # tokens of each conversation's last prompt and answer, as the engine cached them

        async def turn(chat: list[dict], t: int, c: int) -> None:
            nonlocal prompt_blocks, ideal_blocks
            chat.append({"role": "user", "content": text(seed * 1000 + 100 * t + c, 40)})
            body = {"model": model, "messages": chat, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True}
            response = await client.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            answer = response.json()
            chat.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
            usage = answer["usage"]
            prompt_blocks += (usage["prompt_tokens"] - 1) // BLOCK_SIZE  # as the scheduler looks them up
            # The engine caches the blocks its last step computed: all but the answer's last token.
            ideal_blocks += min(max(previous[c] - 1, 0) // BLOCK_SIZE, (usage["prompt_tokens"] - 1) // BLOCK_SIZE)
            previous[c] = usage["total_tokens"]
            replicas[c].append(response.headers.get("x-tern-replica", "?"))

        for t in range(num_turns):
            await asyncio.gather(*(turn(chat, t, c) for c, chat in enumerate(chats)))
        await asyncio.sleep(0.1)
        return prompt_blocks, await prefix_cache_hits(client) - before, replicas, ideal_blocks


async def prefix_cache_hits(client: httpx.AsyncClient) -> int:
    """tern_prefix_cache_hits summed over every replica (the ingress merges their metrics, a second late at most)."""
    await asyncio.sleep(2.0)  # replicas report their metrics each second: wait for a report after the last request
    text_ = (await client.get("/metrics")).text
    return int(sum(float(v) for v in re.findall(r"^tern_prefix_cache_hits_total\{[^}]*\} (\S+)$", text_, re.M)))


def measure(router: str, base_url: str, deploy, seed: int, **options) -> Result:
    """Deploy with `router` (deploy(router) returns when serving), run the conversations, then remove the app."""
    from ray import serve

    deploy(router)
    try:
        started = time.perf_counter()
        prompt_blocks, hits, replicas, ideal = asyncio.run(run_conversations(base_url, seed=seed, **options))
        return Result(router, hits, prompt_blocks, options.get("num_conversations", 8) * options.get("num_turns", 4),
                      time.perf_counter() - started, len({r for turns in replicas for r in turns}),
                      sum(len(set(turns)) == 1 for turns in replicas), ideal)
    finally:
        serve.delete("tern")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: the default model)")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--num-cpus", type=float, default=0.5, help="per replica (2 replicas share this machine)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--routers", nargs="+", default=["pow2", "prefix"], help="the first is the baseline")
    parser.add_argument("--port", type=int, default=8790)
    args = parser.parse_args()

    import logging

    import ray
    from ray import serve

    sys.path.insert(0, str(ROOT))
    from deploy.ray_serve import ScaleSettings, build_app, connect, parse_args

    logging.basicConfig(level="WARNING")
    tern_flags = ["--host", "127.0.0.1", "--port", str(args.port), "--no-compile", "--quantization", args.quantization]
    server, engine_config, _ = parse_args(tern_flags + (["--model", args.model] if args.model else []))
    connect(ScaleSettings(ray_address="local"))
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})

    def deploy(router: str) -> None:
        scale = ScaleSettings(replicas=args.replicas, num_cpus=args.num_cpus, router=router)
        serve.run(build_app(server, engine_config, scale), name="tern", route_prefix="/")

    try:
        results = [measure(router, f"http://127.0.0.1:{args.port}", deploy, seed=i, num_conversations=args.conversations,
                           num_turns=args.turns, max_tokens=args.max_tokens)
                   for i, router in enumerate(args.routers)]
    finally:
        serve.shutdown()
        ray.shutdown()
    baseline = results[0]
    print(f"{args.conversations} conversations x {args.turns} turns, interleaved, {args.replicas} replicas, "
          f"model {args.model or 'default'}")
    print("| router | prompt blocks | prefix-cache hits | hit rate | vs " + baseline.router + " | of the most possible | "
          "replicas answering | conversations on one replica | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ratio = r.hit_rate / baseline.hit_rate if baseline.hit_rate else float("inf")
        print(f"| {r.router} | {r.prompt_blocks} | {r.hit_blocks} | {r.hit_rate:.1%} | {ratio:.2f}x | "
              f"{r.hit_blocks / r.ideal_blocks:.0%} of {r.ideal_blocks} | "
              f"{r.replicas_used} | {r.num_conversations_on_one_replica}/{args.conversations} | {r.seconds:.1f} |")


if __name__ == "__main__":
    main()
