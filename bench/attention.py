"""The decode attention kernel of source trees against each other: milliseconds per call (one layer) for 16 decode
rows (contexts of 150 to 250 positions) and for one 1,024-token prompt attended as decode rows (how the native step
prefills), Llama-3.2-3B's heads (24 query heads, 8 KV heads of 128; --shape 1b: 1B's, 32 of 64 and 8): fp32 and bf16 queries on caches of their own
type, and fp32 queries on a bf16 cache (a float32 model's default KV cache). Each tree in a child
process of its own, alternated rounds (bench/trees.py).

    .venv/bin/python bench/attention.py --trees /tmp/baseline-checkout . [--path avx512] [--shape 1b] [--rounds 3]

The cache's rows are scattered over 8,192 slots, as a paged cache's blocks are. Ratio: a tree's time over the first
tree's in the same round (below 1: faster than the first).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trees import alternate, child_command, print_result  # noqa: E402  bench/trees.py
from trees import parser as trees_parser  # noqa: E402

SHAPES = {"3b": (24, 8, 128), "1b": (32, 8, 64)}  # query heads, KV heads, head size: Llama-3.2-3B's and 1B's
SLOTS = 8192
DECODE_ROWS, PROMPT_TOKENS = 16, 1024


def child(args) -> None:
    sys.path.insert(0, str(Path.cwd()))
    import torch

    from engine import kernels
    from engine.config import default_cache_dir

    attend = kernels.kernels_for(args.path, default_cache_dir()).decode_attention
    HEADS, KV_HEADS, DIM = SHAPES[args.shape]
    generator = torch.Generator().manual_seed(0)
    times = {}
    # float32 queries over a bf16 cache: the engine's float32 model with its default bf16 KV cache
    for dtype, cache_dtype, label in ((torch.float32, torch.float32, "float32"), (torch.bfloat16, torch.bfloat16, "bfloat16"),
                                      (torch.float32, torch.bfloat16, "float32 on bf16 cache")):
        k_cache, v_cache = (torch.randn(SLOTS, KV_HEADS, DIM, generator=generator).to(cache_dtype) for _ in range(2))
        decode_slots = torch.randperm(SLOTS, generator=generator)[: DECODE_ROWS * 250].view(DECODE_ROWS, 250)
        decode_lens = torch.randint(150, 251, (DECODE_ROWS,), generator=generator)
        decode_q = torch.randn(DECODE_ROWS, HEADS, DIM, generator=generator).to(dtype)
        prompt_slots = torch.randperm(SLOTS, generator=generator)[:PROMPT_TOKENS].repeat(PROMPT_TOKENS, 1)
        prompt_lens = torch.arange(1, PROMPT_TOKENS + 1)
        prompt_q = torch.randn(PROMPT_TOKENS, HEADS, DIM, generator=generator).to(dtype)
        for name, calls, inputs in (("decode", 100, (decode_q, decode_slots, decode_lens)),
                                    ("prompt", 3, (prompt_q, prompt_slots, prompt_lens))):
            q, slots, lens = inputs
            attend(q, k_cache, v_cache, slots, lens, DIM**-0.5)
            samples = []
            for _ in range(args.reps):
                started = time.perf_counter()
                for _ in range(calls):
                    attend(q, k_cache, v_cache, slots, lens, DIM**-0.5)
                samples.append((time.perf_counter() - started) / calls * 1e3)
            times[f"{name} {label}"] = statistics.median(samples)
    print_result({"times": times})


def main() -> None:
    parser = trees_parser(__doc__, reps=5)
    parser.add_argument("--path", default="avx512", help="the kernel path (engine/kernels/dispatch.py)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="3b", help="the heads of Llama-3.2-3B or 1B")
    args = parser.parse_args()
    if args.child:
        return child(args)
    trees = [tree.resolve() for tree in args.trees]
    print(f"decode attention, ms per call, median of {args.reps} per round, path {args.path}, {args.shape} heads "
          f"(ratio to {trees[0]})")
    command = child_command(__file__, args, "--path", args.path, "--shape", args.shape)
    for round_, results in alternate(trees, args.rounds, command):
        base = results[trees[0]]["times"]
        for tree in trees:
            cells = [f"{name} {ms:.2f} ({ms / base[name]:.2f}x)" for name, ms in results[tree]["times"].items()]
            print(f"round {round_} | {tree.name or tree} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
