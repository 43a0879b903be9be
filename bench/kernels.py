"""Tern's CPU matmul kernels against torch's own CPU ops on the default model's linear layers, in one run.

    .venv/bin/python bench/kernels.py [--rows 1 16 256] [--reps 5] [--path avx2]
    .venv/bin/python bench/kernels.py --stack 1b --rows 1 16 128 --reps 7    # the 4-bit layouts on 1B shapes
    .venv/bin/python bench/kernels.py --stack 1b --rows 16 32 256 --path amx   # q8, q4, q4k, q6k on AMX against AVX512's

The default stack is one decode step's matmuls of SmolLM2-135M: 30 layers of qkv (960x576), o (576x576), gate_up
(3072x576) and down (576x1536), then the lm_head (49152x576); `--stack 1b` is 4 layers of Llama-3.2-1B's (qkv
3072x2048, o 2048x2048, gate_up 16384x2048, down 2048x8192; no head), where Q4_K's super-blocks fit, so the 4-bit
layouts a GGUF's blocks go into (int4, q4 for Q4_0, q4k for Q4_K) are compared on the same nibbles, and q6k (Q6_K:
a Q4_K_M file's head and half its ffn_down and attn_v) is timed on the same shapes. `rows` is the
batch (1: one stream, 16: sixteen streams, 256: a prefill step). Every candidate but the bf16 ones (the default
stack's bf16 weights, `--quantization none` in bf16, through Tern's bf16 kernel and aten's bf16 matmul on bf16
activations) runs on float32 activations, as the engine runs on CPUs without AVX512-BF16 (aten's int8pack/int4pack
ops are given bf16 activations, their fast case, and converted back).
Candidates alternate within each repetition; each figure is the median, and tok/s is rows over the stack's time.
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

STACKS = {
    "smol": [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)],
    "1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)] * 4,
}
SHAPES = STACKS["smol"]


AMX_TWIN = "avx512"  # the path whose kernels the amx ones replace, timed beside them


def candidates(cpu: kernels.CpuKernels) -> dict[str, callable]:
    """name -> builder of (run(x_by_k)) over the whole stack, each with its own random weights."""
    bf16 = torch.bfloat16

    def q8_weight(n, k):
        return layouts.pack_q8(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n, k // 32).half())

    def tern_q8(q8_mm=cpu.q8_mm):
        def build():
            weights = [(q8_weight(n, k), k) for n, k in SHAPES]
            return lambda xs: [q8_mm(xs[k], w) for w, k in weights]
        return build

    def tern_int4():  # the lm_head stays int8 (q8), as in the engine's int4 mode
        weights = []
        for n, k in SHAPES:
            if n == 49152:
                weights.append(("q8", q8_weight(n, k), k))
            else:
                q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
                weights.append(("int4", layouts.pack_int4(q, torch.rand(n, k // 32).half(), torch.rand(n, k // 32).half()), k))
        return lambda xs: [cpu.q8_mm(xs[k], w) if kind == "q8" else cpu.int4_mm(xs[k], w) for kind, w, k in weights]

    def aten_int8pack():
        weights = [(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n).to(bf16)) for n, k in SHAPES]
        return lambda xs: [torch.ops.aten._weight_int8pack_mm(xs[w.shape[1]].to(bf16), w, s).float() for w, s in weights]

    def aten_int4pack():
        weights = [(torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1),
                    torch.rand(k // 32, n, 2).to(bf16), k) for n, k in SHAPES]
        return lambda xs: [torch.ops.aten._weight_int4pack_mm_for_cpu(xs[k].to(bf16), w, 32, sz).float()
                           for w, sz, k in weights]

    def aten_fp32():
        weights = [torch.randn(n, k) for n, k in SHAPES]
        return lambda xs: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights]

    def tern_q6k(q6k_mm=cpu.q6k_mm):
        def build():
            weights = [(layouts.pack_q6k(torch.randint(0, 64, (n, k), dtype=torch.uint8),
                                         torch.randint(-128, 128, (n, k // 16)).to(torch.int8),
                                         torch.rand(n, k // 256).half() / 100), k) for n, k in SHAPES]
            return lambda xs: [q6k_mm(xs[k], w) for w, k in weights]
        return build

    def tern_4bit(layout: str, q4_mm=cpu.q4_mm, q4k_mm=cpu.q4k_mm):  # the same nibbles in each 4-bit layout
        def build():
            weights = []
            for n, k in SHAPES:
                q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
                if layout == "q4":
                    weights.append((layouts.pack_q4(q, torch.rand(n, k // 32).half()), k, q4_mm))
                elif layout == "q4k":
                    levels = [torch.randint(0, 64, (n, k // 32), dtype=torch.uint8) for _ in range(2)]
                    scales = [torch.rand(n, k // 256).half() / 100 for _ in range(2)]
                    weights.append((layouts.pack_q4k(q, *levels, *scales), k, q4k_mm))
                else:
                    d, m = torch.rand(n, k // 32).half(), torch.rand(n, k // 32).half()
                    weights.append((layouts.pack_int4(q, d, m), k, cpu.int4_mm))
            return lambda xs: [matmul(xs[k], w) for w, k, matmul in weights]
        return build

    def bf16_weights():
        return [(torch.randn(n, k) / k**0.5).to(bf16) for n, k in SHAPES]

    def aten_bf16():
        weights = bf16_weights()
        return lambda xs: [torch.nn.functional.linear(xs[w.shape[1]].to(bf16), w) for w in weights]

    def tern_bf16():  # `--quantization none` in bf16: the same matmuls in Tern's bf16 kernel
        weights = [layouts.pack_bf16(w) for w in bf16_weights()]
        return lambda xs: [cpu.bf16_mm(xs[w.shape[1]].to(bf16), w) for w in weights]

    found = {"aten fp32 (F.linear)": aten_fp32, "aten int8pack (bf16 activations)": aten_int8pack,
             "aten int4pack (bf16 activations)": aten_int4pack}
    if cpu.bf16_mm is not None:
        found["aten bf16 (F.linear)"] = aten_bf16
        found[f"Tern bf16 ({cpu.path})"] = tern_bf16  # which bf16 kernel: the header's describe() line
    if cpu.q8_mm is not None:
        found[f"Tern q8 ({cpu.path})"] = tern_q8()
    if SHAPES is STACKS["1b"]:  # the 4-bit layouts against each other, and q8 (a Q8_0 file's); no head
        found = {f"Tern {layout} ({cpu.path})": tern_4bit(layout) for layout in ("int4", "q4", "q4k")
                 if getattr(cpu, f"{layout}_mm") is not None}
        if cpu.q8_mm is not None:
            found[f"Tern q8 ({cpu.path})"] = tern_q8()
        if cpu.q6k_mm is not None:
            found[f"Tern q6k ({cpu.path})"] = tern_q6k()
        if cpu.path == "amx":  # its kernels against the avx512 ones they replace
            found[f"Tern q4 ({AMX_TWIN})"] = tern_4bit("q4", q4_mm=torch.ops.tern.q4_mm_avx512)
            found[f"Tern q4k ({AMX_TWIN})"] = tern_4bit("q4k", q4k_mm=torch.ops.tern.q4k_mm_avx512)
            found[f"Tern q6k ({AMX_TWIN})"] = tern_q6k(torch.ops.tern.q6k_mm_avx512)
            found[f"Tern q8 ({AMX_TWIN})"] = tern_q8(torch.ops.tern.q8_mm_avx512)
    elif cpu.int4_mm is not None:
        found[f"Tern int4 ({cpu.path})"] = tern_int4
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--path", default=None, help="kernel path (default: what the engine would pick)")
    parser.add_argument("--stack", choices=sorted(STACKS), default="smol")
    args = parser.parse_args()
    global SHAPES
    SHAPES = STACKS[args.stack]
    cpu = kernels.select(default_cache_dir(), args.path)
    built = {name: make() for name, make in candidates(cpu).items()}
    print(f"kernels: {cpu.describe()}; torch threads: {torch.get_num_threads()}\n")
    print("| rows | " + " | ".join(built) + " |")
    print("|---|" + "---|" * len(built))
    paired: dict[int, dict[str, float]] = {}
    for rows in args.rows:
        xs = {k: torch.randn(rows, k) for k in {k for _, k in SHAPES}}
        times: dict[str, list[float]] = {name: [] for name in built}
        for rep in range(args.reps):
            # every other repetition in reverse order: a candidate's place in the round costs it little either way
            for name, run in (reversed if rep % 2 else iter)(list(built.items())):
                if rows > 32 and "pack" in name:
                    continue  # aten's packed ops are for decode-sized batches
                started = time.perf_counter()
                run(xs)
                times[name].append(time.perf_counter() - started)
        cells = [f"{statistics.median(t) * 1e3:.1f} ms ({rows / statistics.median(t):.0f} tok/s)" if t else "-"
                 for t in times.values()]
        print(f"| {rows} | " + " | ".join(cells) + " |")
        paired[rows] = {layout: statistics.median(a / b for a, b in zip(times[f"Tern {layout} (amx)"],
                                                                       times[f"Tern {layout} ({AMX_TWIN})"]))
                        for layout in ("q8", "q4", "q4k", "q6k")
                        if cpu.path == "amx" and f"Tern {layout} ({AMX_TWIN})" in times}
    if any(paired.values()):
        # Each repetition runs the two one after the other, so their ratio is steadier on a shared VM than the
        # ratio of the medians above (neighbours' load drifts between repetitions, less within one).
        print("\namx over avx512, median of each repetition's ratio of times:")
        for rows, ratios in paired.items():
            print(f"rows {rows}: " + ", ".join(f"{layout} {ratio:.2f}x" for layout, ratio in ratios.items()))


if __name__ == "__main__":
    main()
