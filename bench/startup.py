"""Start-up time: seconds from launching a server until it is ready, Tern against llama-server and/or another
checkout of Tern (an earlier commit), alternated, medians.

    .venv/bin/python bench/startup.py --rounds 5 --llama-bin ~/.cache/llama-cpp-src/llama.cpp/build/bin \
        [--baseline /tmp/tern-base] [--first-start] [FILE.gguf ...]      # no file: the default model

Ready: /health answers 200 (and for Tern /v1/models says no compile is under way: the server then serves at full
speed). Tern is started as a user starts it, `python app.py [--model FILE]`; a baseline is a checkout of another
commit (`git worktree add /tmp/tern-base <commit>`) run by the same interpreter. Kernels and caches are built
before the rounds (a first start per checkout, not timed). Each round starts every server once, in an order
reversed every other round; 127.0.0.1 only. The requirement: Tern within 5 s of llama-server on the same file.
--first-start times a new file's first start: each Tern start finds the kernels built but not the file's small
caches (its tensor index, config and tokenizer: removed before every start).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.config import default_cache_dir  # noqa: E402
from engine.weights.checkpoint import GGUF_INDEX_KIND, GGUF_METADATA_KIND, default_gguf_path  # noqa: E402
from gguf_servers import free_port, stop_process  # noqa: E402
from rounds import _cpu_flags  # noqa: E402
from trees import write_bytecode  # noqa: E402
POLL_S = 0.02


def command(server: str, checkout: Path, model: Path | None, port: int, llama_bin: Path | None) -> list[str]:
    if server == "llama-server":
        return [str(llama_bin / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                "-t", "2", "-np", "1", "--log-disable"]
    return [sys.executable, str(checkout / "app.py"), "--host", "127.0.0.1", "--port", str(port),
            *(["--model", str(model)] if model else [])]


def ready_s(cmd: list[str], cwd: Path, is_tern: bool, timeout_s: float = 900, env: dict | None = None) -> float:
    """Seconds from launch until ready; the server is stopped after."""
    port = int(cmd[cmd.index("--port") + 1])
    base = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    process = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        with httpx.Client(timeout=5) as client:
            while time.perf_counter() - started < timeout_s:
                if process.poll() is not None:
                    raise SystemExit(f"{' '.join(cmd)} exited with {process.returncode}")
                try:
                    if client.get(f"{base}/health").status_code == 200 and (
                            not is_tern or client.get(f"{base}/v1/models").json()["data"][0]["decode_step"]
                            != "compiling"):
                        return time.perf_counter() - started
                except (httpx.HTTPError, KeyError, IndexError, ValueError):
                    pass
                time.sleep(POLL_S)
        raise SystemExit(f"{' '.join(cmd)}: not ready after {timeout_s} s")
    finally:
        stop_process(process, timeout_s=30)


def forget_file(model: Path | None, cache: Path) -> None:
    """Remove what a start caches about `model` (engine/weights/checkpoint.py: its tensor index, config and
    tokenizer), so the next start reads the file as a first start does; the built kernels stay."""
    stem = (model or default_gguf_path()).stem
    for kind in (GGUF_INDEX_KIND, GGUF_METADATA_KIND):
        for entry in (cache / kind).glob(f"{stem}-*"):
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def cache_of(name: str, checkout: Path) -> Path:
    """The cache folder a Tern server uses. The baseline keeps one of its own: a build of other kernel sources
    replaces the cache's library, so two checkouts sharing one would rebuild on every start."""
    return checkout / ".bench-cache" if name == "tern-baseline" else default_cache_dir()


def environment(name: str, checkout: Path) -> dict:
    if name == "tern-baseline":
        return {**os.environ, "TERN_CACHE": str(cache_of(name, checkout))}
    return dict(os.environ)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", type=Path, help="GGUF files (default: Tern's default model)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--llama-bin", type=Path, help="llama-server's folder; needs a model file")
    parser.add_argument("--baseline", type=Path, help="another checkout of Tern to compare with (e.g. a worktree)")
    parser.add_argument("--first-start", action="store_true", help="time a new file's first start (see above)")
    args = parser.parse_args()
    servers = [("tern", ROOT)]
    if args.baseline:
        servers.append(("tern-baseline", args.baseline.resolve()))
    flags = " ".join(sorted(f for f in _cpu_flags() if f == "avx2" or f.startswith("avx512")))
    what = "a new file's first start (kernels built)" if args.first_start else "seconds from launch to ready"
    print(f"CPU: {flags}; {args.rounds} rounds, alternated; {what}, median (min-max)")
    for model in args.models or [None]:
        contenders = servers + ([("llama-server", ROOT)] if args.llama_bin and model else [])
        for name, checkout in contenders:  # a first start builds kernels and caches: not timed
            if name != "llama-server":
                write_bytecode(checkout)
            ready_s(command(name, checkout, model, free_port(), args.llama_bin), checkout, name != "llama-server",
                    env=environment(name, checkout))
        times: dict[str, list[float]] = {name: [] for name, _ in contenders}
        for round_index in range(args.rounds):
            order = contenders if round_index % 2 == 0 else contenders[::-1]
            for name, checkout in order:
                cmd = command(name, checkout, model, free_port(), args.llama_bin)
                if args.first_start and name != "llama-server":
                    forget_file(model, cache_of(name, checkout))
                times[name].append(ready_s(cmd, checkout, name != "llama-server", env=environment(name, checkout)))
        medians = {name: statistics.median(values) for name, values in times.items()}
        print(f"\n{model.name if model else 'default model'}:")
        for name, values in times.items():
            extra = ""
            if name != "llama-server" and "llama-server" in medians:
                extra = f"  ({medians[name] - medians['llama-server']:+.2f} s vs llama-server)"
            print(f"  {name:14s} {medians[name]:6.2f} s ({min(values):.2f}-{max(values):.2f}){extra}")


if __name__ == "__main__":
    main()
