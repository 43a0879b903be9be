"""Memory given back when a model unloads: the process's resident memory (RSS) before the default model loads through
the ModelRegistry, once it has loaded and answered a request, and after it was unloaded (its keep-alive passed),
for two load/unload rounds. The first round also pays for what any first load imports and keeps (kernels, tokenizer
code); the second shows what a model costs on its own.

    .venv/bin/python bench/unload_memory.py [--model PATH] [--rounds 2] [--max-growth 0.10]

With --max-growth it exits 1 when the median over the rounds after the first of (RSS after the unload - RSS before the
load) / RSS before exceeds that fraction (tests/engine/test_unload_memory.py). The first is reported, not judged: what
it keeps of a first load (+5-10% on the 2-core VM) depends on how much the process had imported before it. The median,
because in about one round in twenty on that VM most of a model (~700 MB) is freed only after the registry's
malloc_trim has run (no Engine object is alive by then, and a second malloc_trim gives it back): a late free not yet
traced, which the next unload's trim returns.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import EngineConfig, SamplingParams  # noqa: E402
from engine.registry import UNLOADED, ModelRegistry, ModelSpec  # noqa: E402

KEEP_ALIVE_S = 0.5


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def one_round(registry: ModelRegistry) -> tuple[float, float, float]:
    before = rss_mib()
    lease = registry.acquire()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    lease.engine.generate([lease.engine.tokenizer.encode("The capital of France is")], params)
    loaded = rss_mib()
    lease.release()  # drops its engine: nothing here keeps the model's memory
    deadline = time.monotonic() + 60
    while registry.status().state != UNLOADED:
        assert time.monotonic() < deadline, "the model never unloaded"
        time.sleep(0.05)
    return before, loaded, rss_mib()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model's GGUF")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-growth", type=float, default=None, help="fail past this growth, e.g. 0.10")
    args = parser.parse_args()
    if args.max_growth is not None and args.rounds < 2:
        parser.error("--max-growth judges the rounds after the first: give --rounds 2 or more")
    growths = []
    config = EngineConfig.serving(model=args.model, compile=False)
    registry = ModelRegistry([ModelSpec("model", config, keep_alive_s=KEEP_ALIVE_S)]).start()
    try:
        for number in range(1, args.rounds + 1):
            before, loaded, after = one_round(registry)
            print(f"round {number}: RSS before load {before:.0f} MiB, loaded {loaded:.0f} MiB, after unload "
                  f"{after:.0f} MiB ({(after - before) / before:+.1%} of before)")
            if number > 1:
                growths.append((after - before) / before)
    finally:
        registry.stop()
    if args.max_growth is not None and statistics.median(growths) > args.max_growth:
        sys.exit(f"unloads after the first gave back too little: {statistics.median(growths):+.1%} (median) over the "
                 "RSS before their load")


if __name__ == "__main__":
    main()
