"""The int8 multiply-add ceiling of this CPU's AVX2 units: what Tern's AVX2 kernels (and llama.cpp's) can reach at
most, to set their GMAC/s against (bench/kernels.py --stack 1b --path avx2).

    .venv/bin/python bench/avx2_ceiling.py [--cores 2]

AVX2 has no int8 dot-product instruction that accumulates (AVX-VNNI's vpdpbusd is not in the AVX2-only CPUs this is
for), so an int8 matmul's inner loop is vpmaddubsw (32 byte products summed in int16 pairs) and an add that gathers
the pairs: no fewer than one add per vpmaddubsw. Measured here with g++ on a few lines of inline assembly, each
timed on one core over 10^8 iterations (independent registers, no memory):
- the clock, from a chain of dependent 64-bit multiplies (3 cycles each on every x86 core of the last decade);
- vpmaddubsw alone, per cycle;
- vpmaddubsw + vpaddw pairs, per cycle: the loop's ceiling; times 32 multiply-adds, the cycles' and cores' count.
- q8's loop (Q8_0 weights: both operands signed): vpmaddubsw wants one unsigned, so per register of weights one vpxor
  (the stored q + 128 back to q) and one vpabsb, then per activation row a vpsignb (x with q's sign), the vpmaddubsw,
  a vpmaddwd that widens its pairs (two pairs of 127 * 127 products overflow int16, so they cannot sum in int16 first)
  and a vpaddd: engine/kernels/csrc/q8_avx2.cpp's instructions for 4 rows, timed the same way, as multiply-adds a cycle;
  then the same with the kernel's vpbroadcastd of each row's 4 activation bytes from memory (on Zen 3 it issues at
  ~1.9 a cycle, no faster than the multiplies, so it is not free).
- q8 by int16 (a route tried for it): the weight register's bytes spread into two int16 registers by two vpshufb (each
  row's columns 0-1 and 2-3), then per row two vpbroadcastd of an int16 activation pair and two vpmaddwd and vpaddd,
  for 8 rows. It multiplies as often as the sign trick (vpmaddubsw and vpmaddwd share the two multiply pipes) and saves
  only the vpsignb: ~1.1x the sign trick's rate on Zen 3, yet slower in the kernel (engine/kernels/README.md).
A kernel also unpacks its weights and applies each block's scales, so it stays below these ceilings.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define M(d) "vpmaddubsw %%ymm15, %%ymm14, %%ymm" #d "\n"
#define A(s, d) "vpaddw %%ymm" #s ", %%ymm" #d ", %%ymm" #d "\n"
/* one activation row (register x) against the weight register's sign (ymm12) and magnitude (ymm13): acc += ... */
#define Q8(x, t, acc) "vpsignb %%ymm12, %%ymm" #x ", %%ymm" #t "\n vpmaddubsw %%ymm" #t ", %%ymm13, %%ymm" #t "\n" \
  "vpmaddwd %%ymm15, %%ymm" #t ", %%ymm" #t "\n vpaddd %%ymm" #t ", %%ymm" #acc ", %%ymm" #acc "\n"
/* the same row, its activation bytes broadcast from memory first, as the kernel does */
#define Q8B(off, x, t, acc) "vpbroadcastd " #off "(%0), %%ymm" #x "\n" Q8(x, t, acc)
/* int16 row: two broadcasts of a row's (x0, x1) and (x2, x3) pairs, two vpmaddwd against the spread weight registers
   ymm9 and ymm10, two vpaddd */
#define W16(off, t, u, acc) "vpbroadcastd " #off "(%0), %%ymm" #t "\n vpbroadcastd " #off "+4(%0), %%ymm" #u "\n" \
  "vpmaddwd %%ymm9, %%ymm" #t ", %%ymm" #t "\n vpmaddwd %%ymm10, %%ymm" #u ", %%ymm" #u "\n" \
  "vpaddd %%ymm" #t ", %%ymm" #acc ", %%ymm" #acc "\n vpaddd %%ymm" #u ", %%ymm" #acc ", %%ymm" #acc "\n"
#define SPREAD "vmovdqu (%1), %%ymm8\n vpshufb (%2), %%ymm8, %%ymm9\n vpshufb 32(%2), %%ymm8, %%ymm10\n"
static int mem_x[64] __attribute__((aligned(64)));
static unsigned char mem_w[64] __attribute__((aligned(64))), mem_spread[64] __attribute__((aligned(64)));
#define CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13"
int main(void) {
  const long n = 100000000;
  long x = 3;
  double t = now();
  for (long i = 0; i < n; i++) __asm__ volatile("imul %0, %0\n imul %0, %0\n imul %0, %0\n imul %0, %0" : "+r"(x));
  const double ghz = 12.0 * n / (now() - t) / 1e9;
  t = now();
  for (long i = 0; i < n; i++) __asm__ volatile(M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) ::: CLOBBER);
  const double alone = 8.0 * n / (now() - t) / 1e9 / ghz;
  t = now();
  for (long i = 0; i < n; i++)
    __asm__ volatile(M(0) M(1) M(2) M(3) A(0, 8) A(1, 9) A(2, 10) A(3, 11)
                     M(4) M(5) M(6) M(7) A(4, 12) A(5, 13) A(6, 8) A(7, 9) ::: CLOBBER);
  const double pairs = 8.0 * n / (now() - t) / 1e9 / ghz;
  t = now();
  for (long i = 0; i < n; i++)
    __asm__ volatile("vpxor %%ymm15, %%ymm14, %%ymm12\n vpabsb %%ymm12, %%ymm13\n"
                     Q8(8, 0, 4) Q8(9, 1, 5) Q8(10, 2, 6) Q8(11, 3, 7) ::: CLOBBER);
  const double q8_rows = 4.0 * n / (now() - t) / 1e9 / ghz;  /* rows of one weight register a cycle */
  t = now();
  for (long i = 0; i < n; i++)
    __asm__ volatile("vpxor %%ymm15, %%ymm14, %%ymm12\n vpabsb %%ymm12, %%ymm13\n"
                     Q8B(0, 8, 0, 4) Q8B(4, 9, 1, 5) Q8B(8, 10, 2, 6) Q8B(12, 11, 3, 7) :: "r"(mem_x) : CLOBBER);
  const double q8_broadcast_rows = 4.0 * n / (now() - t) / 1e9 / ghz;
  t = now();
  for (long i = 0; i < n; i++)
    __asm__ volatile(SPREAD W16(0, 11, 12, 0) W16(8, 13, 14, 1) W16(16, 11, 12, 2) W16(24, 13, 14, 3)
                     W16(32, 11, 12, 4) W16(40, 13, 14, 5) W16(48, 11, 12, 6) W16(56, 13, 14, 7)
                     :: "r"(mem_x), "r"(mem_w), "r"(mem_spread) : CLOBBER, "xmm14", "xmm15");
  const double int16_rows = 8.0 * n / (now() - t) / 1e9 / ghz;
  printf("%.3f %.3f %.3f %.3f %.3f %.3f\n", ghz, alone, pairs, q8_rows, q8_broadcast_rows, int16_rows);
  return 0;
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cores", type=int, default=os.cpu_count())
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        source, binary = Path(folder) / "ceiling.c", Path(folder) / "ceiling"
        source.write_text(SOURCE)
        subprocess.run(["gcc", "-O2", "-mavx2", "-o", str(binary), str(source)], check=True)
        printed = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
        ghz, alone, pairs, q8_rows, q8_broadcast_rows, int16_rows = map(float, printed.split())
    per_core = 32 * pairs
    print(f"clock {ghz:.2f} GHz; vpmaddubsw {alone:.2f} a cycle alone, {pairs:.2f} a cycle with a vpaddw each")
    print(f"int8 ceiling: {per_core:.1f} multiply-adds a cycle a core, {per_core * ghz * args.cores:.0f} GMAC/s "
          f"on {args.cores} cores")
    q8_per_core = 32 * q8_rows
    print(f"q8 (sign trick) ceiling: {q8_rows:.2f} rows of a weight register a cycle, {q8_per_core:.1f} multiply-adds a "
          f"cycle a core, {q8_per_core * ghz * args.cores:.0f} GMAC/s on {args.cores} cores")
    for name, rows in (("q8 (sign trick, each row's activations broadcast from memory)", q8_broadcast_rows),
                       ("q8 by int16 (vpshufb-spread weights, vpmaddwd)", int16_rows)):
        print(f"{name}: {32 * rows:.1f} multiply-adds a cycle a core, {32 * rows * ghz * args.cores:.0f} GMAC/s "
              f"on {args.cores} cores")


if __name__ == "__main__":
    main()
