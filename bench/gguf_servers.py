"""Tern against llama.cpp's own llama-server on the same GGUF files, alternated rounds, end to end.

    ../shared/tools/llama_server.sh                       # builds llama-server once (~15 min), prints its folder
    ../shared/tools/make_model.py llama1b /tmp/llama1b ... --quants Q4_0,Q4_K_M,Q8_0   # random 1B-shaped GGUFs
    .venv/bin/python bench/gguf_servers.py --llama-bin ~/.cache/llama-cpp-src/llama.cpp/build/bin \
        --rounds 2 FILE.gguf [FILE.gguf ...]              # no file: the default model
    ... --rounds 3 --starts-only FILE.gguf                # ready and memory at ready only

Per file and round (the order of the servers reversed every other round), each server alone on the machine:
- llama-server `-t 2 -np 1` for one stream and the prefill, `-np 16` for 16 streams (continuous batching over slots);
- Tern: `python app.py --model FILE` with no other flag, as a user starts it.
Measured: seconds from launch to ready (/health 200, and for Tern no compile under way), the server's resident
memory at ready (VmHWM: the peak of loading; VmRSS; Tern's once its KV pool, which faults in just after, is whole)
and its peak after the runs, one stream's and 16 streams' output tokens/s (~100-token prompts, 128 tokens,
ignore_eos, bench/serve.py), and the time to first token of a ~1,500-token prompt (prefill).
Ratios are Tern over llama-server within a round. 127.0.0.1 only.

One stream against the physics: the VM's streaming read bandwidth moves by a third from one minute to the next, so
it is measured around each one-stream run (read_gbs: a sum over 1 GiB, best of 5, just before and just after), and
each server's decode rate (bench/serve.py's per-stream tok/s, first token excluded) is shown as a share of
bandwidth / bytes a token reads (every weight tensor, the embedding table only when the head is a tensor of its own).
"""
from __future__ import annotations

import argparse
import asyncio
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
from rounds import kernel_flags  # noqa: E402
from trees import write_bytecode  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process(process: subprocess.Popen, timeout_s: float = 60) -> None:
    """Ask a server to exit; kill it if it has not after `timeout_s`."""
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def command(server: str, model: Path, port: int, llama_bin: Path, slots: int) -> list[str]:
    if server == "llama-server":
        return [str(llama_bin / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                "-t", "2", "-np", str(slots), "-c", str(max(4096, 512 * slots)), "--log-disable"]
    return [sys.executable, str(ROOT / "app.py"), "--host", "127.0.0.1", "--port", str(port), "--model", str(model)]


def read_through(model: Path) -> None:
    """Read the file once before its rounds, so that it is in the page cache for every start: otherwise whichever
    server starts first reads it from disk (a 3B file's first Tern start took 14.5 s, its second 7.1)."""
    with open(model, "rb") as file:
        while file.read(1 << 24):
            pass


def read_gbs(gib: int = 1, repeats: int = 5) -> float:
    """The machine's streaming read rate now, GB/s, as ../shared/tools/membw.py measures it (read_gbs): a float32
    sum over `gib` GiB (torch, every core), best of `repeats`; the buffer is freed before a server runs again."""
    import torch

    data = torch.ones(gib << 28)
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass faults the pages in
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best / 1e9


def bytes_per_token(model: Path) -> int:
    """The weight bytes one decoded token reads: every tensor, but the embedding table only when the output
    head is a tensor of its own (then a token reads one row of it; tied, the head reads it whole)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(model).tensors}
    untied = "output.weight" in tensors
    return sum(n for name, n in tensors.items() if not (untied and name == "token_embd.weight"))


def memory_mb(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            fields[key] = int(value.split()[0]) / 1024
    return fields


def kernel_path(server: str, pid: int, log: Path) -> str:
    """Which CPU code the server runs, for the table's header: Tern's log line (TERN_CPU_KERNELS may force a path
    below the CPU's best), and the ggml CPU library llama-server mapped (LD_LIBRARY_PATH may swap in a build for
    an older instruction set)."""
    if server == "llama-server":
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        return next((line.split()[-1] for line in maps if "libggml-cpu" in line), "libggml-cpu: not mapped")
    line = next((line for line in log.read_text().splitlines() if "CPU kernels:" in line), "")
    return line.partition("CPU kernels:")[2].strip() or "CPU kernels: not in the log"


class Server:
    def __init__(self, server: str, model: Path, llama_bin: Path, slots: int, log_dir: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(log_dir / f"{server}-{model.stem}-{self.port}.log", "w")
        self.started = time.perf_counter()
        self.process = subprocess.Popen(command(server, model, self.port, llama_bin, slots), cwd=ROOT,
                                        stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "TERN_LOG_LEVEL": "info"})
        self.ready_s = self._wait_ready()
        self._wait_memory_settled()  # Tern's pool faults in just after ready: its memory counts here
        self.at_ready = memory_mb(self.process.pid)  # VmHWM now: the peak of loading, before any request
        self.kernels = kernel_path(server, self.process.pid, Path(self.log.name))

    def _wait_ready(self) -> float:
        deadline = time.monotonic() + 1800
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"server exited with {self.process.returncode}; see {self.log.name}")
            try:
                if httpx.get(f"{self.base}/health", timeout=5).status_code == 200:
                    card = httpx.get(f"{self.base}/v1/models", timeout=5).json()["data"][0]
                    if card.get("decode_step") != "compiling":
                        return time.perf_counter() - self.started
            except (httpx.HTTPError, KeyError, IndexError, ValueError):
                pass
            time.sleep(0.25)
        raise SystemExit(f"not ready after 1800 s; see {self.log.name}")

    def _wait_memory_settled(self) -> None:
        """Tern's KV pool resident and its weights moved into huge pages (both after ready, in the background)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            card = httpx.get(f"{self.base}/v1/models", timeout=5).json()["data"][0]
            # llama-server's cards have no such fields
            if card.get("kv_cache_resident", True) and card.get("weights_settled", True):
                return
            time.sleep(0.1)

    def sweep(self, concurrency: int, prompt_tokens: int = 100, max_tokens: int = 128) -> dict:
        args = argparse.Namespace(base_url=f"{self.base}/v1", model=None, api_key=None, concurrency=[concurrency],
                                  prompt_tokens=prompt_tokens, max_tokens=max_tokens, requests_per_level=None,
                                  intruder_tokens=0, intruder_delay=3.0, timeout=900, openai_fields_only=False)
        [row] = asyncio.run(serve.main_async(args))
        if row["errors"]:
            raise SystemExit(f"errors: {row['first_error']}")
        return row

    def prefill_s(self, prompt_tokens: int) -> float:
        """Time to the first token of one long prompt (a different one each time: no prefix cache)."""
        row = self.sweep(1, prompt_tokens=prompt_tokens, max_tokens=1)
        return row["ttft_p50_s"]

    def stop(self) -> dict[str, float]:
        memory = memory_mb(self.process.pid)
        stop_process(self.process)
        return memory


def measure(server: str, model: Path, args) -> dict:
    result = {}
    first = Server(server, model, args.llama_bin, 1, args.log_dir)
    try:
        result["kernels"] = first.kernels
        result["ready_s"] = first.ready_s
        result["load_peak_mb"] = first.at_ready.get("VmHWM", float("nan"))
        result["ready_mb"] = first.at_ready.get("VmRSS", float("nan"))
        if args.starts_only:
            return result
        before = read_gbs()
        one = first.sweep(1)
        result["read_gbs"] = (before + read_gbs()) / 2
        result["c1"], result["c1_decode"] = one["output_tok_s"], one["stream_decode_tok_s"]
        result["prefill_s"] = first.prefill_s(args.prefill_tokens)
        if server != "llama-server":
            result["c16"] = first.sweep(16)["output_tok_s"]
    finally:
        memory = first.stop()
    result["peak_mb"], result["steady_mb"] = memory.get("VmHWM", float("nan")), memory.get("VmRSS", float("nan"))
    if server == "llama-server":  # its slots are fixed at start: 16 streams need -np 16
        wide = Server(server, model, args.llama_bin, 16, args.log_dir)
        try:
            result["c16"] = wide.sweep(16)["output_tok_s"]
        finally:
            wide.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", type=Path)
    parser.add_argument("--llama-bin", type=Path, required=True, help="the folder holding llama-server")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prefill-tokens", type=int, default=1500)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    parser.add_argument("--starts-only", action="store_true",
                        help="only start each server and stop it once ready: ready s and memory at ready, a minute a "
                             "file where the whole run takes half an hour")
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    if not args.models:
        sys.path.insert(0, str(ROOT))
        from engine.weights.checkpoint import default_gguf_path

        args.models = [default_gguf_path()]
    servers = ["tern", "llama-server"]
    write_bytecode(ROOT)  # Tern's own modules compiled, as a user's second start finds them
    table = []
    for model in args.models:
        read_through(model)
        rounds = {name: [] for name in servers}
        table.append((model, rounds))
        for index in range(args.rounds):
            for name in servers if index % 2 == 0 else servers[::-1]:
                result = measure(name, model, args)
                rounds[name].append(result)
                print(f"{model.name} round {index + 1} {name}: {result}", flush=True)
            is_last = model == args.models[-1] and index == args.rounds - 1
            if not is_last:  # a run stopped early (a 3B round takes half an hour) still leaves its table so far
                print(f"\nSo far (through round {index + 1} of {model.name}):")
                print_tables(table, servers, args)
    print(f"\n{args.rounds} alternated rounds; CPU flags: {kernel_flags()}; {os.cpu_count()} cores")
    print_tables(table, servers, args)


def print_tables(table: list, servers: list[str], args) -> None:
    """The speed and memory table, and one stream against the bandwidth ceiling, of the rounds run so far."""
    for name in servers:
        paths = sorted({r["kernels"] for _, rounds in table for r in rounds[name]})
        print(f"{name} ran: {'; '.join(paths)}")
    print()
    if args.starts_only:
        print("| GGUF | file MiB | ready s Tern vs llama-server (median difference) | peak MiB loading | "
              "resident MiB at ready |")
        print("|---|---|---|---|---|")
        for model, rounds in table:
            tern, llama = rounds["tern"], rounds["llama-server"]

            def both(key: str, digits: int) -> str:
                return (", ".join(f"{r[key]:.{digits}f}" for r in tern) + " vs "
                        + ", ".join(f"{r[key]:.{digits}f}" for r in llama))

            behind = statistics.median(a["ready_s"] - b["ready_s"] for a, b in zip(tern, llama))
            print(f"| {model.name} | {model.stat().st_size / 2**20:.0f} | {both('ready_s', 1)} (**{behind:+.1f} s**) | "
                  f"{both('load_peak_mb', 0)} | {both('ready_mb', 0)} |")
        sys.stdout.flush()
        return
    # MiB throughout (/proc's kB / 1024 for memory), so memory / (file + KV) is one unit's ratio.
    print("| GGUF | file MiB | 1 stream tok/s Tern vs llama-server | 16 streams | prefill s (~"
          f"{args.prefill_tokens} tokens) | ready s | peak MiB loading | resident MiB at ready | "
          "peak MiB after the runs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, rounds in table:
        tern, llama = rounds["tern"], rounds["llama-server"]

        def pair(key: str, higher_is_better: bool = True) -> str:
            ours, theirs = [r[key] for r in tern], [r[key] for r in llama]
            ratios = [(a / b if higher_is_better else b / a) for a, b in zip(ours, theirs)]
            return (f"{', '.join(f'{v:.1f}' for v in ours)} vs {', '.join(f'{v:.1f}' for v in theirs)} "
                    f"(**{statistics.median(ratios):.2f}x**)")

        def plain(key: str) -> str:
            return (f"{', '.join(f'{r[key]:.0f}' for r in tern)} vs "
                    f"{', '.join(f'{r[key]:.0f}' for r in llama)}")

        print(f"| {model.name} | {model.stat().st_size / 2**20:.0f} | {pair('c1')} | {pair('c16')} | "
              f"{pair('prefill_s', higher_is_better=False)} | {pair('ready_s', higher_is_better=False)} | "
              f"{plain('load_peak_mb')} | {plain('ready_mb')} | {plain('peak_mb')} |")

    print("\nOne stream against the bandwidth ceiling (read GB/s around each run / bytes a token reads), per round:\n")
    print("| GGUF | MB a token | Tern: read GB/s, ceiling tok/s, decode tok/s (share) | "
          "llama-server: read GB/s, ceiling, decode (share) |")
    print("|---|---|---|---|")
    for model, rounds in table:
        per_token = bytes_per_token(model)

        def shares(runs: list[dict]) -> str:
            return "; ".join(f"{r['read_gbs']:.1f}, {r['read_gbs'] * 1e9 / per_token:.1f}, {r['c1_decode']:.1f} "
                             f"(**{r['c1_decode'] * per_token / (r['read_gbs'] * 1e9):.0%}**)" for r in runs)

        print(f"| {model.name} | {per_token / 1e6:.0f} | {shares(rounds['tern'])} | "
              f"{shares(rounds['llama-server'])} |")

    sys.stdout.flush()


if __name__ == "__main__":
    main()
