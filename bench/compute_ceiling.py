"""How close Tern's 4-bit kernel runs to the CPU's integer multiply-add peak, and what that peak allows at 16 streams.

    .venv/bin/python bench/compute_ceiling.py [--shape llama1b|llama3b] [--reps 5]

With many rows (16 streams, a prefill) a 4-bit matmul is bound by compute, not by reading the weights: every
weight byte is multiplied by each row. On AVX512-VNNI one `vpdpbusd` does 64 int8 multiply-adds (MACs); the 4-bit
kernel's (int4_avx512.cpp) each take 64 weights (16 rows x 4 columns of low or high nibbles) times 4 activation
bytes, all useful, so its ceiling is the machine's vpdpbusd rate times 64.
This script measures that rate (a C++ loop of independent vpdpbusd, one process per core, all cores at once), then
Tern's int4 matmul over the decoder stack of a model shape (random weights, float32 activations) at 1, 16 and 256
rows, and prints the MAC rate of each against the peak. Last, the ceiling of bench/gguf_servers.py's 16-stream run
(two waves of 16 requests, each a ~100-token prompt then 128 tokens: every MAC of prefill and decode at the peak,
nothing else) as output tokens per second. Needs g++ and an AVX512-VNNI CPU.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import kernels  # noqa: E402
from engine.config import default_cache_dir  # noqa: E402
from engine.kernels import layouts  # noqa: E402

# hidden, intermediate, layers, query heads x head dim, kv heads x head dim (Llama-3.2 shapes; SmolLM2's vocabulary)
SHAPES = {"llama1b": (2048, 8192, 16, 2048, 512), "llama3b": (3072, 8192, 28, 3072, 1024)}
VOCAB = 49152
PEAK_SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
// Twelve accumulators in named registers (an array ends up in memory), each a chain of vpdpbusd: the latency
// (~5 cycles) is hidden, so the loop runs at the instruction's throughput.
#define STEP(acc) acc = _mm512_dpbusd_epi32(acc, a, b)
int main() {
  __m512i a0 = _mm512_set1_epi32(0), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
          a9 = a0, a10 = a0, a11 = a0;
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
  const long iters = 100000000;
  auto t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < iters; ++n) {
    STEP(a0); STEP(a1); STEP(a2); STEP(a3); STEP(a4); STEP(a5);
    STEP(a6); STEP(a7); STEP(a8); STEP(a9); STEP(a10); STEP(a11);
    __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7),
                     "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));  // keeps the loop from being folded away
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  __m512i sum = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
                                 _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));
  sum = _mm512_add_epi32(sum, _mm512_add_epi32(_mm512_add_epi32(a8, a9), _mm512_add_epi32(a10, a11)));
  printf("%.6f %d\n", iters * 12 * 64 / s / 1e9, _mm512_reduce_add_epi32(sum) & 1);
}
"""


def vnni_peak_gmac_s(cores: int) -> float:
    """Multiply-adds per second (G) of vpdpbusd on `cores` cores at once, one process each."""
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "peak.cpp", Path(tmp) / "peak"
        source.write_text(PEAK_SOURCE)
        subprocess.run(["g++", "-O2", "-mavx512f", "-mavx512bw", "-mavx512vnni", str(source), "-o", str(binary)],
                       check=True)
        runs = [subprocess.Popen([str(binary)], stdout=subprocess.PIPE, text=True) for _ in range(cores)]
        return sum(float(run.communicate()[0].split()[0]) for run in runs)


def stack(shape: str) -> tuple[list[tuple[int, int]], int]:
    """The decoder stack's matrices (N, K) as Tern fuses them, and the MACs per token of the whole model."""
    hidden, intermediate, layers, q, kv = SHAPES[shape]
    matrices = [(q + 2 * kv, hidden), (hidden, q), (2 * intermediate, hidden), (hidden, intermediate)] * layers
    return matrices, sum(n * k for n, k in matrices) + VOCAB * hidden


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama1b")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    args = parser.parse_args()
    cpu = kernels.select(default_cache_dir(), "avx512")  # the vpdpbusd kernels (amx: tiles for some of them)
    if cpu.path != "avx512":
        raise SystemExit(f"needs the avx512 kernel path (this CPU takes {cpu.path})")
    cores = torch.get_num_threads()
    peak = vnni_peak_gmac_s(cores)
    matrices, macs_per_token = stack(args.shape)
    stack_macs = sum(n * k for n, k in matrices)
    print(f"CPU: {cpu.describe()}; {os.cpu_count()} cores, {cores} threads")
    print(f"vpdpbusd peak, {cores} cores at once: {peak:.0f} GMAC/s\n")
    weights = [layouts.pack_int4(torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.rand(n, k // 32).half(),
                                 torch.rand(n, k // 32).half()) for n, k in matrices]
    print(f"| rows | {args.shape} int4 stack ms | GMAC/s | of the peak |")
    print("|---|---|---|---|")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k) for k in {k for _, k in matrices}}
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            for weight, (_, k) in zip(weights, matrices):
                cpu.int4_mm(xs[k], weight)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        rate = rows * stack_macs / seconds / 1e9
        print(f"| {rows} | {seconds * 1000:.1f} | {rate:.0f} | {rate / peak:.0%} |")
    # bench/gguf_servers.py at 16 streams: 32 requests in two waves of 16, ~100 prompt tokens and 128 out each.
    requests, prompt, output = 32, 100, 128
    total_macs = requests * (prompt + output) * macs_per_token
    ceiling = requests * output / (total_macs / (peak * 1e9))
    print(f"\n16 streams as bench/gguf_servers.py runs them ({requests} requests, {prompt} prompt + {output} output "
          f"tokens, {macs_per_token / 1e9:.2f} GMAC a token): at most {ceiling:.0f} output tok/s at the peak")


if __name__ == "__main__":
    main()
