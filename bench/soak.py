"""Soak: many clients for minutes against one server, a quarter of them leaving early; afterwards the server must
be as it was: every answer complete and right, nothing running or waiting, every KV block free, memory unchanged.

    .venv/bin/python bench/soak.py                                     # default server, 64 clients, 120 s
    .venv/bin/python bench/soak.py --clients 16 --duration-s 20 --json soak.json
    .venv/bin/python bench/soak.py --server-args "--max-num-seqs 16"   # the server it starts gets these flags
    .venv/bin/python bench/soak.py --url http://127.0.0.1:7860 [--pid PID]   # a server already running here

Without --url it starts `app.py` on 127.0.0.1 and a free port (its log goes to --log) and stops it afterwards.
With --url the server must run on this machine: its resident memory is read from /proc (--pid, or the process
listening on the URL's port).

Each client sends requests back to back until the time is up, each a kind drawn at random: a streamed greedy chat
(`chat_stream`), a greedy completion with logprobs (`logprobs`), a streamed seeded chat with n=2 (`n2`), a
`/v1/loglikelihood` scoring (`loglikelihood`), a streamed greedy completion with stop strings (`stop`). A quarter
of the clients misbehave on every request: they close the connection mid-stream, or before the first token (at
the response headers, or a plain request cancelled within half a second). Every request is recorded: kind,
status, latency, whether it was abandoned.

Before the run the same mix warms the server up (--warmup-s), so buffers it allocates lazily are counted in the
memory taken as "before". After the run it checks, and exits 1 if any check fails:
  - no 5xx, and no request that hung (each must end within --timeout-s);
  - every request not abandoned is complete and well formed (one id, one finish_reason per choice at its end,
    [DONE]; logprobs present and consistent where asked) and right, against the same request sent alone afterwards
    on the idle server: a greedy answer is identical, or parts from it only at a near tie (the token taken instead
    was among the alone answer's top 5, within 1 nat: vLLM's own criterion for answers computed in another float
    order, plus a margin); a score is within 0.5 nats per token with the same tokens and is_greedy; a stop
    request's text is the greedy text cut where its first stop string begins, and holds no stop string. Seeded
    n=2 samples are compared and counted, not failed. --exact demands every answer bit for bit;
  - /metrics shows 0 running, 0 waiting and 0 KV blocks used (within --idle-timeout-s);
  - the server's resident memory (VmRSS) is within --memory-tolerance (5%) of its value before the run.
Only point it at servers you run yourself.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import random
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
logger = logging.getLogger("soak")

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Name three birds.",
    "Write a haiku about the sea.",
    "Explain what a CPU does in one sentence.",
    "List four colors.",
    "What is 12 times 7?",
    "Say hello in Spanish.",
    "Describe a cat in two sentences.",
]
COMPLETION_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "def fibonacci(n):",
    "The best way to learn a language is",
    "Water boils at",
]
# Greedy continuations that reach the stop strings within their max_tokens, and some that do not.
STOP_CASES = [
    ("1, 2, 3, 4, 5,", [" 9", "12"]),
    ("Monday, Tuesday, Wednesday,", ["Friday"]),
    ("The alphabet: A, B, C, D,", [" H", "Z"]),
    ("Once upon a time", [".", "\n"]),
    ("Q: What is the capital of France?\nA:", ["\n", "Q:"]),
    ("Here is a list of fruits:\n1.", ["\n3."]),
]
SCORE_PAIRS = [
    ("The capital of France is", " Paris."),
    ("The sky is", " blue."),
    ("2 + 2 =", " 4"),
    ("Birds can", " fly."),
    ("The opposite of hot is", " cold"),
    ("Roses are red, violets are", " blue"),
]
_COUNTERS = ("tern_engine_generated_tokens", "tern_engine_steps")
MAX_TOKENS = (16, 24, 32, 40, 48)  # bounded: on 2 cores the default model decodes ~300 tok/s across all streams
KINDS = ("chat_stream", "logprobs", "n2", "loglikelihood", "stop")
POOL_SIZES = {"chat_stream": len(CHAT_PROMPTS), "logprobs": len(COMPLETION_PROMPTS), "n2": len(CHAT_PROMPTS),
              "loglikelihood": len(SCORE_PAIRS), "stop": len(STOP_CASES)}
STREAMED = {"chat_stream", "n2", "stop"}
LOGPROBS = 2
# Under load a prompt shares its steps with others (prefill chunks, other prompts, mixed decode steps), which changes
# the float order of attention by ~1e-7; with int4 weights the activations' 8-bit rounding magnifies that to ~0.2
# nats in a logprob. So greedy answers may part from the alone one at near ties, and scores move within this much.
TOP_LOGPROBS = 5
TIE_MARGIN_NATS = 1.0
LL_NOISE_NATS = 0.5  # per continuation token


@dataclass
class SoakConfig:
    clients: int = 64
    duration_s: float = 120.0
    warmup_s: float = 10.0
    misbehaving: float = 0.25  # the share of clients that leave every request early
    timeout_s: float = 90.0  # a request that has not ended by then hung
    idle_timeout_s: float = 60.0
    memory_tolerance: float = 0.05
    seed: int = 0
    exact: bool = False  # answers must equal the alone ones bit for bit (no near ties, no score noise)


@dataclass
class Record:
    """One request as its client saw it. result: what the server answered, in a shape replays are compared in."""

    client: int
    kind: str
    key: int  # which body of the kind's pool
    started_s: float  # since the run began
    latency_s: float = 0.0
    status: int | None = None  # None: no response (hung, or the connection failed)
    abandoned: bool = False
    hung: bool = False
    error: str = ""
    problems: list[str] = field(default_factory=list)
    result: dict | None = None
    verdict: str = ""  # against the same request alone: identical, near tie, within noise, differs (sampled), wrong


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class Report:
    config: dict
    base_url: str
    pid: int | None
    records: list[Record]
    checks: list[Check]
    rss_before_bytes: int | None
    rss_after_bytes: int | None
    metrics_after: dict[str, float]
    throughput: dict[str, float]  # the engine's generated tokens and steps while the clients ran (its counters)

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def by_kind(self) -> dict[str, dict]:
        """Per kind: requests, completed, abandoned, errors, p50/p95 latency of the completed ones."""
        table = {}
        for kind in KINDS:
            records = [r for r in self.records if r.kind == kind]
            done = sorted(r.latency_s for r in records if r.status == 200 and not r.abandoned and not r.problems)
            table[kind] = {
                "requests": len(records),
                "completed": len(done),
                "abandoned": sum(r.abandoned for r in records),
                "errors": sum(_is_error(r) for r in records),
                "p50_s": _percentile(done, 0.50),
                "p95_s": _percentile(done, 0.95),
            }
        return table

    def to_json(self) -> dict:
        failures = [asdict(r) for r in self.records if _is_error(r) or r.verdict.startswith("wrong")][:50]
        statuses = Counter(str(r.status) for r in self.records)
        return {
            "config": self.config, "base_url": self.base_url, "pid": self.pid, "passed": self.passed,
            "by_kind": self.by_kind(), "statuses": dict(statuses),
            "rss_before_bytes": self.rss_before_bytes, "rss_after_bytes": self.rss_after_bytes,
            "metrics_after": self.metrics_after, "throughput": self.throughput, "checks": [asdict(c) for c in self.checks], "failures": failures,
        }

    def summary(self) -> str:
        config = self.config
        num_bad = round(config["clients"] * config["misbehaving"])
        lines = [
            f"soak: {config['clients']} clients ({num_bad} misbehaving) for {config['duration_s']:.0f} s against "
            f"{self.base_url} (pid {self.pid}); {len(self.records)} requests",
            "",
            f"| {'kind':<13} | requests | completed | abandoned | errors | p50 s | p95 s |",
            "|---|---|---|---|---|---|---|",
        ]
        for kind, row in self.by_kind().items():
            lines.append(f"| {kind:<13} | {row['requests']:>8} | {row['completed']:>9} | {row['abandoned']:>9} | "
                         f"{row['errors']:>6} | {_seconds(row['p50_s'])} | {_seconds(row['p95_s'])} |")
        statuses = Counter(str(r.status) for r in self.records)
        run = self.throughput
        lines += ["", f"engine while the clients ran ({run['seconds']:.0f} s, in-flight requests included): "
                  f"{run['generated_tokens']:.0f} tokens generated ({run['generated_tokens'] / run['seconds']:.1f} "
                  f"tok/s) in {run['steps']:.0f} steps"]
        lines += ["statuses: " + ", ".join(f"{status} x{count}" for status, count in sorted(statuses.items()))]
        if self.rss_before_bytes and self.rss_after_bytes:
            change = self.rss_after_bytes / self.rss_before_bytes - 1
            lines.append(f"memory (VmRSS): before {self.rss_before_bytes / 2**20:.1f} MiB, after "
                         f"{self.rss_after_bytes / 2**20:.1f} MiB ({change:+.1%})")
        lines.append("metrics after: " + ", ".join(f"{k} {v:g}" for k, v in self.metrics_after.items()))
        lines += ["", "checks:"] + [f"  {'PASS' if c.passed else 'FAIL'} {c.name}: {c.detail}" for c in self.checks]
        return "\n".join(lines)


def run_soak(base_url: str, pid: int | None, config: SoakConfig) -> Report:
    """Warm up, measure memory, run the load, then check the server (see the module docstring)."""
    return asyncio.run(_run_soak(base_url.rstrip("/"), pid, config))


@contextlib.contextmanager
def local_server(args: list[str], log_path: Path, start_timeout_s: float = 600.0) -> Iterator[tuple[str, int]]:
    """app.py on 127.0.0.1 and a free port, healthy; yields (base URL, pid) and stops it afterwards."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--host", "127.0.0.1", "--port", str(port),
                                    *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}; its log: {log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server was not healthy after {start_timeout_s:.0f} s; its log: {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.25)
        yield base_url, process.pid
        if process.poll() is not None:
            raise RuntimeError(f"the server died during the soak with {process.returncode}; its log: {log_path}")
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def rss_bytes(pid: int) -> int:
    """VmRSS of a process, from /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def listening_pid(port: int) -> int | None:
    """The pid of the local process listening on this TCP port (the socket's inode, found among /proc/*/fd)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(table).read_text().splitlines()[1:]:
                fields = row.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in inodes:
                        return int(proc.name)
    return None


def engine_load(base_url: str) -> dict[str, float]:
    """What must be 0 on an idle server: sequences running, waiting, and KV blocks in use."""
    return _scrape(base_url, ("tern_num_requests_running", "tern_num_requests_waiting", "tern_kv_cache_blocks_used"))


def _scrape(base_url: str, names: tuple[str, ...]) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    found = {f.name: f.samples[0].value for f in text_string_to_metric_families(text) if f.name in names}
    return {name: found.get(name, math.nan) for name in names}


def request_body(kind: str, key: int, model: str, with_stop: bool = True) -> tuple[str, dict]:
    """(path, JSON body) of a kind's key-th request; the same key gives the same body, so it can be replayed."""
    max_tokens = MAX_TOKENS[key % len(MAX_TOKENS)]
    if kind == "chat_stream":
        return "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": CHAT_PROMPTS[key]}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
        }
    if kind == "n2":
        return "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": CHAT_PROMPTS[key]}], "max_tokens": max_tokens,
            "temperature": 0.8, "seed": 1000 + key, "n": 2, "stream": True,
        }
    if kind == "logprobs":
        return "/v1/completions", {
            "model": model, "prompt": COMPLETION_PROMPTS[key], "max_tokens": max_tokens, "temperature": 0,
            "logprobs": LOGPROBS,
        }
    if kind == "stop":
        prompt, stop = STOP_CASES[key]
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        return "/v1/completions", {**body, "stop": stop} if with_stop else body
    if kind == "loglikelihood":
        pairs = [SCORE_PAIRS[key], SCORE_PAIRS[(key + 1) % len(SCORE_PAIRS)]]
        return "/v1/loglikelihood", {"model": model, "prompts": [p for p, _ in pairs],
                                     "continuations": [c for _, c in pairs]}
    raise ValueError(kind)


# --- the load ---------------------------------------------------------------------------------------------------


async def _run_soak(base_url: str, pid: int | None, config: SoakConfig) -> Report:
    limits = httpx.Limits(max_connections=config.clients + 8, max_keepalive_connections=config.clients + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=config.timeout_s + 30, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        started = time.monotonic()
        if config.warmup_s > 0:
            logger.info("warming up: %d clients for %.0f s", config.clients, config.warmup_s)
            await _load(client, model, config, config.warmup_s, seed=config.seed + 1)
        await _wait_idle(base_url, config.idle_timeout_s)
        rss_before = rss_bytes(pid) if pid else None
        logger.info("%.0f s: soaking: %d clients for %.0f s", time.monotonic() - started, config.clients, config.duration_s)
        counters = await asyncio.to_thread(_scrape, base_url, _COUNTERS)
        run_started = time.monotonic()
        records = await _load(client, model, config, config.duration_s, seed=config.seed)
        run_s = time.monotonic() - run_started
        counters = {k: v - counters[k] for k, v in (await asyncio.to_thread(_scrape, base_url, _COUNTERS)).items()}
        idle = await _wait_idle(base_url, config.idle_timeout_s)
        rss_after = rss_bytes(pid) if pid else None
        logger.info("%.0f s: %d requests; sending each alone", time.monotonic() - started, len(records))
        await _replay(client, model, records, config)
        logger.info("%.0f s: done", time.monotonic() - started)
    checks = _checks(records, idle, rss_before, rss_after, config)
    throughput = {"seconds": run_s, "generated_tokens": counters["tern_engine_generated_tokens"],
                  "steps": counters["tern_engine_steps"]}
    return Report(asdict(config), base_url, pid, records, checks, rss_before, rss_after, idle, throughput)


async def _load(client: httpx.AsyncClient, model: str, config: SoakConfig, duration_s: float, seed: int) -> list[Record]:
    records: list[Record] = []
    started = time.monotonic()
    num_bad = round(config.clients * config.misbehaving)
    await asyncio.gather(*(
        _client_loop(client, model, index, index < num_bad, started, duration_s, config.timeout_s,
                     random.Random(seed * 100_003 + index), records)
        for index in range(config.clients)
    ))
    return records


async def _client_loop(client, model: str, index: int, misbehaves: bool, started: float, duration_s: float,
                       timeout_s: float, rng: random.Random, records: list[Record]) -> None:
    """Requests back to back until the time is up; a misbehaving client leaves each one early, in turn mid-stream
    and before the first token."""
    await asyncio.sleep(rng.uniform(0, 1))  # spread the first arrivals
    count = 0
    while time.monotonic() - started < duration_s:
        kind = rng.choice(KINDS)
        record = Record(index, kind, rng.randrange(POOL_SIZES[kind]), time.monotonic() - started)
        leave = None
        if misbehaves:
            mid_stream = count % 2 == 0 and kind in STREAMED
            leave = ("after", rng.randint(1, 4)) if mid_stream else ("before", rng.uniform(0, 0.5))
        count += 1
        path, body = request_body(kind, record.key, model)
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(_send(client, record, path, body, leave), timeout_s)
        except TimeoutError:
            record.hung, record.error = True, f"no end after {timeout_s:.0f} s"
        except (httpx.HTTPError, ValueError) as exc:  # ValueError: a body that is not JSON
            record.error = f"{type(exc).__name__}: {exc}"
        record.latency_s = time.monotonic() - t0
        records.append(record)


async def _send(client: httpx.AsyncClient, record: Record, path: str, body: dict, leave: tuple | None) -> None:
    """Send one request, filling record: status, result (None when abandoned), problems with the answer."""
    if not body.get("stream"):
        task = asyncio.ensure_future(client.post(path, json=body))
        try:
            if leave is not None:
                done, _ = await asyncio.wait({task}, timeout=leave[1])
                record.abandoned = not done
            response = None if record.abandoned else await task
        finally:  # cancelled (left early, or timed out): httpx closes the connection, the server should abort
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if response is None:
            return
        record.status = response.status_code
        if response.status_code != 200:
            record.error = response.text[:300]
            return
        record.result = _check_plain(record.kind, response.json(), record.problems)
        return
    async with client.stream("POST", path, json=body) as response:
        record.status = response.status_code
        if response.status_code != 200:
            record.error = (await response.aread()).decode(errors="replace")[:300]
            return
        if leave is not None and leave[0] == "before":  # the headers came, no token yet: close the connection
            record.abandoned = True
            return
        events, done = [], False
        leave_after = leave[1] if leave is not None else None
        async for line in response.aiter_lines():
            if not line or line.startswith(":"):
                continue
            if not line.startswith("data: "):
                record.problems.append(f"not an SSE data line: {line[:100]!r}")
                continue
            if line == "data: [DONE]":
                done = True
                break
            events.append(json.loads(line[len("data: "):]))
            if leave_after is not None and sum(_has_text(e) for e in events) >= leave_after:
                record.abandoned = True
                return
        if not done:
            record.problems.append("the stream ended without data: [DONE]")
        record.result = _check_stream(record.kind, events, body, record.problems)


def _has_text(event: dict) -> bool:
    return any((c.get("delta") or {}).get("content") or c.get("text") for c in event.get("choices", []))


# --- what a complete answer looks like ----------------------------------------------------------------------------


def _check_stream(kind: str, events: list[dict], body: dict, problems: list[str]) -> dict:
    """Chat or completion chunks: one id, each choice's text and its one finish_reason, at its end."""
    errors = [e["error"] for e in events if "error" in e]
    if errors:
        problems.append(f"error event: {errors[0]}")
        return {}
    if len({e.get("id") for e in events}) != 1:
        problems.append("chunks carry different ids")
    n = body.get("n", 1)
    texts, finishes = [""] * n, [[] for _ in range(n)]
    for event in events:
        for choice in event.get("choices", []):
            i = choice["index"]
            if finishes[i]:
                problems.append(f"choice {i} has a chunk after its finish_reason")
            texts[i] += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            if choice.get("finish_reason"):
                finishes[i].append(choice["finish_reason"])
    for i in range(n):
        if len(finishes[i]) != 1:
            problems.append(f"choice {i}: finish_reason {finishes[i]} (want exactly one)")
    if kind != "stop":  # chat: the role comes first, in each choice's first chunk
        for i in range(n):
            first = next((e["choices"][0] for e in events if e.get("choices") and e["choices"][0]["index"] == i), {})
            if (first.get("delta") or {}).get("role") != "assistant":
                problems.append(f"choice {i}: the first delta carries no role")
    if body.get("stream_options", {}).get("include_usage") and not (events and events[-1].get("usage")):
        problems.append("no usage chunk before [DONE]")
    return {"texts": texts, "finish_reasons": [f[0] if f else None for f in finishes]}


def _check_plain(kind: str, answer: dict, problems: list[str]) -> dict:
    if kind == "loglikelihood":
        ll, greedy, tokens = answer.get("ll", []), answer.get("is_greedy", []), answer.get("tokens", [])
        if not (len(ll) == len(greedy) == len(tokens) == 2):
            problems.append(f"want 2 scores, got ll {ll} is_greedy {greedy} tokens {tokens}")
        if any(not isinstance(x, float) or x > 0 for x in ll) or any(not t for t in tokens):
            problems.append(f"scores out of range: ll {ll} tokens {tokens}")
        return {"ll": ll, "is_greedy": greedy, "tokens": tokens}
    choice = answer["choices"][0]
    logprobs = choice.get("logprobs") or {}
    tokens = logprobs.get("tokens")
    completion_tokens = answer["usage"]["completion_tokens"]
    if tokens is None:
        problems.append("logprobs asked for, none returned")
        return {"text": choice["text"], "finish_reason": choice["finish_reason"]}
    lists = [logprobs.get(k) or [] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")]
    if any(len(values) != completion_tokens for values in lists):
        problems.append(f"logprobs lists of lengths {[len(v) for v in lists]} for {completion_tokens} tokens")
    if any(lp is None or lp > 0 for lp in logprobs["token_logprobs"]):
        problems.append(f"token_logprobs out of range: {logprobs['token_logprobs']}")
    if any(not top or len(top) > LOGPROBS + 1 or max(top.values()) > 0 for top in logprobs["top_logprobs"]):
        problems.append(f"top_logprobs malformed: {logprobs['top_logprobs']}")
    joined, text = "".join(tokens), choice["text"]
    # An end-of-sequence token is listed (it was generated) but is not in the text.
    if joined != text and not (choice["finish_reason"] == "stop" and "".join(tokens[:-1]) == text):
        problems.append(f"logprob tokens {joined!r} do not add up to the text {text!r}")
    return {"text": text, "tokens": tokens, "finish_reason": choice["finish_reason"]}


# --- after the run --------------------------------------------------------------------------------------------------


async def _wait_idle(base_url: str, timeout_s: float) -> dict[str, float]:
    """Polls /metrics until nothing runs, waits or holds a KV block, and /v1/models until the KV pool is resident
    (it faults in after start: engine/pool_memory.py); returns the last load reading either way."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = await asyncio.to_thread(engine_load, base_url)
        resident = await asyncio.to_thread(_memory_settled, base_url)
        if (not any(load.values()) and resident) or time.monotonic() > deadline:
            return load
        await asyncio.sleep(0.25)


def _memory_settled(base_url: str) -> bool:
    cards = httpx.get(base_url + "/v1/models", timeout=30).json()["data"]
    return all(card.get("kv_cache_resident", True) is not False and card.get("weights_settled", True) is not False
               for card in cards)


async def _replay(client: httpx.AsyncClient, model: str, records: list[Record], config: SoakConfig) -> None:
    """Each distinct request that completed, sent again alone on the idle server; sets each record's verdict."""
    for kind, key in sorted({(r.kind, r.key) for r in records if _compared(r)}):
        group = [r for r in records if (r.kind, r.key) == (kind, key) and _compared(r)]
        alone = Record(-1, kind, key, 0.0)
        path, body = request_body(kind, key, model)
        await asyncio.wait_for(_send(client, alone, path, body, None), config.timeout_s)
        if alone.status != 200 or alone.problems:
            for record in group:
                record.verdict = f"wrong: alone it failed ({alone.status} {alone.error} {alone.problems})"
            continue
        greedy = None  # the alone answer with its top logprobs, for answers that differ from it
        if kind == "stop":  # alone, too, the text must end where the first stop string begins
            greedy = await _greedy_with_logprobs(client, model, kind, key, config.timeout_s)
            verdict = _compare_greedy(kind, key, alone.result, greedy, config.exact)
            if verdict.startswith("wrong"):
                for record in group:
                    record.verdict = f"wrong: alone, {verdict}"
                continue
        for record in group:
            if kind == "stop" and any(s in record.result["texts"][0] for s in STOP_CASES[key][1]):
                record.verdict = f"wrong: a stop string is in the text {record.result['texts'][0]!r}"
            elif record.result == alone.result and kind != "stop":
                record.verdict = "identical"
            elif kind == "loglikelihood":
                record.verdict = _compare_scores(record.result, alone.result, config.exact)
            elif kind == "n2":
                record.verdict = "wrong: differs" if config.exact else "differs (sampled)"
            else:
                greedy = greedy or await _greedy_with_logprobs(client, model, kind, key, config.timeout_s)
                record.verdict = _compare_greedy(kind, key, record.result, greedy, config.exact)


def _compared(record: Record) -> bool:
    return bool(record.result) and not record.abandoned and not record.problems


async def _greedy_with_logprobs(client: httpx.AsyncClient, model: str, kind: str, key: int, timeout_s: float) -> dict:
    """The request as a plain completion (chat: its template's token ids) without stop strings, with the top
    TOP_LOGPROBS alternatives at every token: what an answer that parts from it is measured against. Its
    "entries" hold each token's bytes, logprob and rivals as (bytes, logprob).

    A legacy completion names tokens by their text, so two byte tokens of one character (an emoji's last byte)
    both read '\ufffd' and one hides the other in top_logprobs; a chat answer gives every token's bytes. So a chat
    request's entries come from the same request through /v1/chat/completions, as far as it shows them (chat hides
    the end-of-sequence token that ended it: that one keeps the completion's)."""
    path, body = request_body(kind, key, model, with_stop=False)
    chat_body = None
    if kind == "chat_stream":
        tokenized = await client.post("/tokenize", json={"messages": body["messages"]}, timeout=timeout_s)
        chat_body = {"model": model, "messages": body["messages"], "max_tokens": body["max_tokens"], "temperature": 0,
                     "logprobs": True, "top_logprobs": TOP_LOGPROBS}
        body = {"model": model, "prompt": tokenized.json()["tokens"], "max_tokens": body["max_tokens"], "temperature": 0}
    body = {**body, "stream": False, "logprobs": TOP_LOGPROBS}
    body.pop("stream_options", None)
    choice = (await client.post("/v1/completions", json=body, timeout=timeout_s)).json()["choices"][0]
    logprobs = choice["logprobs"]
    entries = [(token.encode(), logprob, [(t.encode(), lp) for t, lp in top.items()])
               for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"])]
    if chat_body is not None:
        chat = (await client.post("/v1/chat/completions", json=chat_body, timeout=timeout_s)).json()["choices"][0]
        shown = [(bytes(e["bytes"]), e["logprob"], [(bytes(t["bytes"]), t["logprob"]) for t in e["top_logprobs"]])
                 for e in chat["logprobs"]["content"]]
        entries[:len(shown)] = shown
    return {**choice, "entries": entries}


def _compare_greedy(kind: str, key: int, result: dict, greedy: dict, exact: bool) -> str:
    """A greedy answer that differs from the one alone is right if it parts from it at a near tie: where the alone
    answer's token and the one taken instead were both among its top TOP_LOGPROBS, within TIE_MARGIN_NATS. That is
    vLLM's test of answers computed in another float order (tests/models/utils.py, check_logprobs_close), with a
    margin. A stop request's text must also be the alone text cut where its first stop string begins."""
    text = result["texts"][0] if "texts" in result else result["text"]
    finish = result["finish_reasons"][0] if "finish_reasons" in result else result["finish_reason"]
    if kind == "stop":
        expected = _cut_at_stop(greedy["text"], STOP_CASES[key][1])
        if (text, finish) == (expected, "stop" if expected != greedy["text"] else greedy["finish_reason"]):
            return "identical"
    if exact:
        return f"wrong: {text!r} (finish {finish}) != alone {greedy['text']!r}"
    return _near_tie(greedy["entries"], text.encode(), finish, kind == "stop")


def _near_tie(entries: list[tuple[bytes, float, list[tuple[bytes, float]]]], text: bytes, finish: str | None,
              may_stop: bool) -> str:
    """Compared in bytes, so a rival that is part of a character (one byte of an emoji) counts like any other."""
    tokens = [token for token, _, _ in entries]
    offsets = [0]
    for token in tokens:
        offsets.append(offsets[-1] + len(token))
    alone = b"".join(tokens)
    at = next((i for i, (a, b) in enumerate(zip(alone, text)) if a != b), min(len(alone), len(text)))
    k = next((i for i, (o, t) in enumerate(zip(offsets, tokens)) if o + len(t) > at), None)
    if k is None:
        return f"wrong: {text!r} goes on where alone {alone!r} ended"
    # The token taken instead is the alone token's (k) rival, as the text shows it (" " for " Celsius", then
    # "180°"), or began before the first differing byte and runs past it (" Bananas" for " Banana" + "\n").
    for j in range(k, -1, -1):
        if offsets[j] < at - 64:
            break
        rest = text[offsets[j]:]
        chosen = entries[j][1]
        for token, logprob in entries[j][2]:
            if token == tokens[j] or chosen - logprob > TIE_MARGIN_NATS or (j < k and offsets[j] + len(token) <= at):
                continue
            # It shows in the text; or the text ended there (end of sequence, or the start of a stop string).
            ended_here = finish == "stop" and token.startswith(rest) and (may_stop or _is_special(token))
            if rest.startswith(token) or ended_here:
                return f"near tie: {token!r} for {tokens[j]!r} at token {j} ({chosen - logprob:.2f} nats apart)"
    return (f"wrong: at token {k} alone took {tokens[k]!r} (top {entries[k][2]}), under load the text "
            f"went on {text[offsets[k]:][:30]!r}")


def _is_special(token: bytes) -> bool:
    return token.startswith(b"<|") and token.endswith(b"|>")


def _compare_scores(got: dict, alone: dict, exact: bool) -> str:
    if got["tokens"] != alone["tokens"]:
        return f"wrong: tokens {got['tokens']} != alone {alone['tokens']}"
    if exact:
        return f"wrong: {got} != alone {alone}"
    tolerance = [LL_NOISE_NATS * len(tokens) for tokens in alone["tokens"]]
    if any(abs(a - b) > tol for a, b, tol in zip(got["ll"], alone["ll"], tolerance)):
        return f"wrong: ll {got['ll']} != alone {alone['ll']} (within {tolerance})"
    if got["is_greedy"] != alone["is_greedy"]:
        return f"wrong: is_greedy {got['is_greedy']} != alone {alone['is_greedy']}"
    return f"within noise: ll {got['ll']} vs alone {alone['ll']}"


def _cut_at_stop(text: str, stops: list[str]) -> str:
    """The text a request with these stop strings answers, given its text without them."""
    found = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return text[:min(found)[1]] if found else text


def _checks(records: list[Record], idle: dict, rss_before: int | None, rss_after: int | None,
            config: SoakConfig) -> list[Check]:
    server_errors = [r for r in records if r.status is not None and r.status >= 500]
    hung = [r for r in records if r.hung]
    incomplete = [r for r in records if not r.abandoned and not r.hung and (r.status != 200 or r.problems)]
    wrong = [r for r in records if r.verdict.startswith("wrong")]
    verdicts = Counter(r.verdict.split(":")[0] for r in records if r.verdict)
    stopped = sum(1 for r in records if r.kind == "stop" and r.result and r.result["finish_reasons"] == ["stop"])
    gaps = [float(m.group(1)) for r in records if (m := re.search(r"\(([0-9.]+) nats apart\)", r.verdict))]
    checks = [
        Check("no 5xx", not server_errors, _examples(server_errors) or f"{len(records)} requests"),
        Check("none hung", not hung, _examples(hung) or f"every request ended within {config.timeout_s:.0f} s"),
        Check("every request not abandoned is complete", not incomplete,
              _examples(incomplete) or f"{sum(not r.abandoned for r in records)} complete"),
        Check("answers under load agree with answers alone", not wrong,
              "; ".join(f"{r.kind}[{r.key}] client {r.client} at {r.started_s:.1f} s: {r.verdict}"[:400]
                        for r in wrong[:3]) or ", ".join(f"{v} {n}" for v, n in sorted(verdicts.items()))
              + (f" (the widest near tie {max(gaps):.2f} nats)" if gaps and not wrong else "")
              + f"; {stopped} stop requests ended by a stop string or EOS"),
        Check("idle afterwards", not any(idle.values()), ", ".join(f"{k} {v:g}" for k, v in idle.items())),
    ]
    if rss_before and rss_after:
        change = rss_after / rss_before - 1
        checks.append(Check(f"memory within {config.memory_tolerance:.0%}", abs(change) <= config.memory_tolerance,
                            f"VmRSS {rss_before / 2**20:.1f} -> {rss_after / 2**20:.1f} MiB ({change:+.1%})"))
    else:
        checks.append(Check("memory", True, "not measured: no pid for this server"))
    return checks


def _is_error(record: Record) -> bool:
    return record.hung or bool(record.error or record.problems) or (record.status not in (None, 200))


def _examples(records: list[Record]) -> str:
    return "; ".join(f"{r.kind} client {r.client} status {r.status}: {r.error or r.problems}"[:300] for r in records[:3])


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1] if len(values) > 1 else values[0]


def _seconds(value: float | None) -> str:
    return f"{value:5.2f}" if value is not None else "    -"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=120.0)
    parser.add_argument("--warmup-s", type=float, default=10.0, help="the same mix before memory is measured")
    parser.add_argument("--misbehaving", type=float, default=0.25, help="share of clients that leave early")
    parser.add_argument("--timeout-s", type=float, default=90.0, help="a request not ended by then hung")
    parser.add_argument("--memory-tolerance", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exact", action="store_true",
                        help="answers must equal the same requests alone bit for bit (default: greedy ones may part "
                        "at a near tie, scores move within noise, seeded samples are not compared)")
    parser.add_argument("--url", help="a server already running on this machine (default: start one)")
    parser.add_argument("--pid", type=int, help="with --url: the server's pid (default: the port's listener)")
    parser.add_argument("--server-args", default="", help="flags for the server it starts (default: none)")
    parser.add_argument("--log", type=Path, help="the started server's log (default: a temporary file)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    config = SoakConfig(args.clients, args.duration_s, args.warmup_s, args.misbehaving, args.timeout_s,
                        memory_tolerance=args.memory_tolerance, seed=args.seed, exact=args.exact)
    if args.url:
        pid = args.pid or listening_pid(httpx.URL(args.url).port or 80)
        report = run_soak(args.url, pid, config)
    else:
        log = args.log or Path(tempfile.mkstemp(prefix="tern-soak-server-", suffix=".log")[1])
        logger.info("starting the server (log: %s)", log)
        with local_server(shlex.split(args.server_args), log) as (base_url, pid):
            report = run_soak(base_url, pid, config)
    print(report.summary())
    if args.json:
        args.json.write_text(json.dumps(report.to_json(), indent=2))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
