"""Prefill speed of source trees against each other: the time to first token of fresh prompts in an in-process
engine, each tree in a child process of its own, alternated rounds (the order reversed every other round), ratios
taken within a round.

    .venv/bin/python bench/prefill.py --trees /tmp/baseline-checkout . --tokens 200 1500 [--model FILE.gguf] \
        [--quantization none]

Each child loads the model as the server does (EngineConfig.serving(), without the background compile), prefills
a warm-up prompt, then times --reps prompts of each length (max_tokens 1; different token ids each time, so the
prefix cache never serves them) and prints the median seconds. Ratio: a tree's median over the first tree's in the
same round (below 1: faster than the first). A baseline checkout: `git worktree add /tmp/baseline-checkout <commit>`.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trees import alternate, child_command, print_result  # noqa: E402  bench/trees.py
from trees import parser as trees_parser  # noqa: E402


def child(args) -> None:
    sys.path.insert(0, str(Path.cwd()))
    from engine import Engine, EngineConfig, SamplingParams

    fields = {"quantization": args.quantization} if args.quantization else {}
    with Engine(EngineConfig.serving(model=args.model, compile=False, **fields)) as engine:
        vocab = engine.vocab_size
        engine.generate([list(range(100, 164))], SamplingParams(max_tokens=1))
        medians = {}
        for n in args.tokens:
            times = []
            for rep in range(args.reps):
                prompt = [(1000 + 7 * i + 131 * rep + n) % (vocab - 1000) + 500 for i in range(n)]
                started = time.perf_counter()
                engine.generate([prompt], SamplingParams(max_tokens=1))
                times.append(time.perf_counter() - started)
            medians[n] = statistics.median(times)
    print_result({"path": engine.info().decode_step, "medians": medians})


def main() -> None:
    parser = trees_parser(__doc__, reps=3)
    parser.add_argument("--quantization", help="instead of the server's (auto), e.g. none: bf16 on AVX512-BF16 CPUs")
    parser.add_argument("--tokens", type=int, nargs="+", default=[200, 1500])
    args = parser.parse_args()
    if args.child:
        return child(args)
    trees = [tree.resolve() for tree in args.trees]
    print(f"prefill, median of {args.reps} prompts per length, seconds (ratio to {trees[0]})")
    command = child_command(__file__, args, "--tokens", *map(str, args.tokens),
                            *(["--quantization", args.quantization] if args.quantization else []))
    for round_, results in alternate(trees, args.rounds, command):
        base = results[trees[0]]["medians"]
        for tree in trees:
            result = results[tree]
            cells = [f"{n} tokens {result['medians'][str(n)]:.2f} s ({result['medians'][str(n)] / base[str(n)]:.2f}x)"
                     for n in args.tokens]
            print(f"round {round_} | {tree.name or tree} ({result['path']}) | " + " | ".join(cells))


if __name__ == "__main__":
    main()
