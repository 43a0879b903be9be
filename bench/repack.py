"""GGUF repacking at load (torch.ops.tern.gguf_repack, engine/kernels/csrc/gguf_repack_avx2.cpp) of source trees
against each other: values a second for each GGUF type into the layout a load puts it in, on 2 threads, each tree in a
child process of its own, alternated rounds (bench/trees.py).

    .venv/bin/python bench/repack.py --trees /tmp/baseline-checkout . [--rows 8192 --cols 3072] [--rounds 3]

The blocks are random bytes (the repack moves bits; it computes nothing that depends on their values, but for the
types it re-quantizes into q8, which are not timed here). Each tree builds its kernels into a cache folder of its own
(TREE/.bench-cache): trees sharing one would rebuild on every round. Ratio: a tree's rate over the first tree's in
the same round (above 1: faster than the first).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trees import alternate, child_command, print_result  # noqa: E402  bench/trees.py
from trees import parser as trees_parser  # noqa: E402

# name: (ggml type id, bytes per 256 values, GgufLayout id): what a load does with each type (engine/gguf_blocks.py)
CASES = {"Q4_0 -> q4": (2, 144, 2), "Q4_K -> q4k": (12, 144, 3), "Q5_K -> q5k": (13, 176, 5),
         "Q6_K -> q6k": (14, 210, 4), "Q8_0 -> q8": (8, 272, 0)}


def child(args) -> None:
    sys.path.insert(0, str(Path.cwd()))
    import torch
    from engine import kernels

    repack = kernels.kernels_for("avx2", Path.cwd() / ".bench-cache").gguf_repack
    generator = torch.Generator().manual_seed(0)
    rates = {}
    for name, (ggml_type, block_bytes, layout) in CASES.items():
        raw = torch.randint(0, 256, (args.rows, args.cols // 256 * block_bytes), dtype=torch.uint8, generator=generator)
        out = repack(raw, ggml_type, args.cols, layout)
        samples = []
        for _ in range(args.reps):
            started = time.perf_counter()
            repack(raw, ggml_type, args.cols, layout, out)
            samples.append(args.rows * args.cols / (time.perf_counter() - started) / 1e9)
        rates[name] = statistics.median(samples)
    print_result({"rates": rates})


def main() -> None:
    parser = trees_parser(__doc__, reps=7)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=3072, help="a multiple of 256")
    args = parser.parse_args()
    if args.child:
        return child(args)
    trees = [tree.resolve() for tree in args.trees]
    print(f"GGUF repacking, {args.rows} x {args.cols} values, Gvalues/s, median of {args.reps} (ratio to {trees[0]})")
    command = child_command(__file__, args, "--rows", str(args.rows), "--cols", str(args.cols))
    for round_, results in alternate(trees, args.rounds, command):
        base = results[trees[0]]["rates"]
        for tree in trees:
            rates = results[tree]["rates"]
            cells = [f"{name} {rate:.2f} ({rate / base[name]:.2f}x)" for name, rate in rates.items()]
            print(f"round {round_} | {tree.name or tree} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
