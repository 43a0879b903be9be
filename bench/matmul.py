"""The block matmuls (torch.ops.tern.*_mm: a GGUF's 4-, 6- and 8-bit layouts) of source trees against each other, on
4 layers of Llama-3.2-1B's shapes (bench/kernels.py --stack 1b), each tree in a child process of its own, alternated
rounds (bench/trees.py): for a change to one kernel loop, whose gain the VM's drift between runs would hide.

    .venv/bin/python bench/matmul.py --trees /tmp/baseline-checkout . [--rows 2 4 16 64] [--layouts q4 q8] [--rounds 3]

Each child builds the kernels of the path the engine would pick here (or --path), times every layout at every row
count --reps times, the layouts alternating within each repetition, and prints the medians. Weights and activations
are random, the same in every tree (seeded). Ratio: a tree's rate over the first tree's in the same round (above 1:
faster than the first).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trees import alternate, child_command, print_result  # noqa: E402  bench/trees.py
from trees import parser as trees_parser  # noqa: E402

SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)] * 4  # (N, K): qkv, o, gate_up, down
LAYOUTS = ("q4", "int4", "q4k", "q6k", "q8")


def build(layout: str, cpu, layouts, torch, generator) -> list:
    """(packed weight, K, matmul) per shape, random values of the layout's range."""
    def ints(low, high, shape):
        return torch.randint(low, high, shape, dtype=torch.uint8 if low >= 0 else torch.int8, generator=generator)

    def halves(shape, scale=1.0):
        return (torch.rand(shape, generator=generator) * scale).half()

    weights = []
    for n, k in SHAPES:
        if layout == "q4":
            weights.append((layouts.pack_q4(ints(0, 16, (n, k)), halves((n, k // 32))), k, cpu.q4_mm))
        elif layout == "int4":
            weights.append((layouts.pack_int4(ints(0, 16, (n, k)), halves((n, k // 32)), halves((n, k // 32))), k,
                            cpu.int4_mm))
        elif layout == "q4k":
            packed = layouts.pack_q4k(ints(0, 16, (n, k)), ints(0, 64, (n, k // 32)), ints(0, 64, (n, k // 32)),
                                      halves((n, k // 256), 0.01), halves((n, k // 256), 0.01))
            weights.append((packed, k, cpu.q4k_mm))
        elif layout == "q6k":
            packed = layouts.pack_q6k(ints(0, 64, (n, k)), ints(-128, 128, (n, k // 16)), halves((n, k // 256), 0.01))
            weights.append((packed, k, cpu.q6k_mm))
        else:
            weights.append((layouts.pack_q8(ints(-127, 128, (n, k)), halves((n, k // 32))), k, cpu.q8_mm))
    return weights


def child(args) -> None:
    sys.path.insert(0, str(Path.cwd()))
    import torch

    from engine import kernels
    from engine.config import default_cache_dir
    from engine.kernels import layouts

    cpu = kernels.select(default_cache_dir(), args.path)
    generator = torch.Generator().manual_seed(0)
    stacks = {layout: build(layout, cpu, layouts, torch, generator) for layout in args.layouts}
    rates = {}
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=generator) for k in {k for _, k in SHAPES}}
        samples: dict[str, list[float]] = {layout: [] for layout in stacks}
        for rep in range(args.reps):
            for layout, weights in (reversed if rep % 2 else iter)(list(stacks.items())):
                started = time.perf_counter()
                for w, k, matmul in weights:
                    matmul(xs[k], w)
                samples[layout].append(rows / (time.perf_counter() - started))
        rates.update({f"{layout} x{rows}": statistics.median(s) for layout, s in samples.items()})
    print_result({"rates": rates, "path": cpu.describe()})


def main() -> None:
    parser = trees_parser(__doc__, reps=7)
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 4, 16, 64])
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--path", default=None, help="kernel path (default: what the engine would pick)")
    args = parser.parse_args()
    if args.child:
        return child(args)
    trees = [tree.resolve() for tree in args.trees]
    extra = ["--rows", *map(str, args.rows), "--layouts", *args.layouts] + (["--path", args.path] if args.path else [])
    command = child_command(__file__, args, *extra)
    print(f"block matmuls, 1B shapes x 4 layers, rows/s (tok/s of the stack), median of {args.reps} "
          f"(ratio to {trees[0]})")
    for round_, results in alternate(trees, args.rounds, command):
        base = results[trees[0]]["rates"]
        if round_ == 1:
            print(f"kernels: {results[trees[0]]['path']}")
        for tree in trees:
            rates = results[tree]["rates"]
            cells = [f"{name} {rate:.0f} ({rate / base[name]:.2f}x)" for name, rate in rates.items()]
            print(f"round {round_} | {tree.name or tree} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
