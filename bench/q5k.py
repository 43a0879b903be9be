"""q5k (a GGUF's Q5_K in its own 176 bytes per 256 values) against q8, the layout Q5_K went into before (re-quantized
per 32 values, 8.5 bits per weight), on the same values, alternated in one process.

    .venv/bin/python bench/q5k.py [--rows 1 16] [--reps 21] [--path avx2] [--threads 1]

Per shape and batch, the q5k kernel on a random valid Q5_K matrix and the q8 kernel on that matrix's values
re-quantized into q8 (quant.pack_q8 of layouts.dequantize_q5k: what the loader built for a Q5_K tensor until q5k),
run in turn each repetition; each figure is the median, GB/s the weight bytes read over that time, and the ratio
q5k's time over q8's. `--threads 1` where another process shares the cores: two threads then wait on each other's
time slices, which hides the kernels.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import kernels  # noqa: E402
from engine.config import default_cache_dir  # noqa: E402
from engine.kernels import layouts  # noqa: E402
from engine.weights import quant  # noqa: E402

SHAPES = [(2048, 2048), (8192, 2048)]  # a 1B model's o projection, and its gate or up projection


def q5k_matrix(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """Random valid Q5_K values, with scales of a real layer's size (weights of a few hundredths)."""
    q = torch.randint(0, 32, (n, k), dtype=torch.uint8, generator=generator)
    scale, minimum = (torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=generator) for _ in range(2))
    d, dmin = ((torch.rand(n, k // 256, generator=generator) * 1e-3 + 5e-4).half() for _ in range(2))
    return layouts.pack_q5k(q, scale, minimum, d, dmin)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--path", default=None, help="kernel path (default: what the engine would pick)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = kernels.select(default_cache_dir(), args.path)
    if cpu.q5k_mm is None or cpu.q8_mm is None:
        raise SystemExit(f"the {cpu.path} path has no q5k or q8 kernel")
    print(f"kernels: {cpu.describe()}; torch threads: {torch.get_num_threads()}\n")
    print("| shape | rows | q5k | q8 (same values) | q5k / q8 time |")
    print("|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        q5k = q5k_matrix(n, k, generator)
        q8 = quant.pack_q8(layouts.dequantize_q5k(q5k))
        for rows in args.rows:
            x = torch.randn(rows, k, generator=generator)
            runs = {"q5k": (cpu.q5k_mm, q5k), "q8": (cpu.q8_mm, q8)}
            times: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(args.reps):
                for name, (matmul, weight) in runs.items():
                    started = time.perf_counter()
                    matmul(x, weight)
                    times[name].append(time.perf_counter() - started)
            medians = {name: statistics.median(t) for name, t in times.items()}
            cells = [f"{medians[name] * 1e6:.0f} us, {weight.numel() / medians[name] / 1e9:.1f} GB/s"
                     for name, (_, weight) in runs.items()]
            print(f"| {n}x{k} | {rows} | {cells[0]} | {cells[1]} | **{medians['q5k'] / medians['q8']:.2f}x** |")


if __name__ == "__main__":
    main()
