"""Decode speed of source trees against each other: output tokens/s of one stream and of 16 concurrent streams in
an in-process engine, each tree in a child process of its own, alternated rounds (bench/trees.py).

    .venv/bin/python bench/decode.py --trees /tmp/baseline-checkout . [--model FILE.gguf] [--rounds 3]

Each child loads the model as the server does (EngineConfig.serving(), without the background compile, which the
kernel paths do not use), decodes a warm-up, then per repetition one stream of --tokens tokens after a 20-token
prompt and 16 streams of --tokens / 2 (ignore_eos: every stream runs to its length) and prints the medians. Tokens
are sampled at --temperature, 1 by default as the API's requests are (0: greedy).
Ratio: a tree's rate over the first tree's in the same round (above 1: faster than the first).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trees import alternate, child_command, print_result  # noqa: E402  bench/trees.py
from trees import parser as trees_parser  # noqa: E402

STREAMS = 16


def prompt(rep: int, stream: int, vocab: int) -> list[int]:
    """20 token ids no other repetition or stream shares, so the prefix cache serves none of them."""
    return [(1000 + 13 * i + 7919 * rep + 131 * stream) % (vocab - 1000) + 500 for i in range(20)]


def child(args) -> None:
    sys.path.insert(0, str(Path.cwd()))
    from engine import Engine, EngineConfig, SamplingParams

    with Engine(EngineConfig.serving(model=args.model, compile=False)) as engine:
        vocab = engine.vocab_size
        engine.generate([prompt(-1, 0, vocab)], SamplingParams(max_tokens=8, ignore_eos=True))
        rates: dict[str, list[float]] = {"1": [], str(STREAMS): []}
        for rep in range(args.reps):
            started = time.perf_counter()
            engine.generate([prompt(rep, 0, vocab)], SamplingParams(max_tokens=args.tokens, ignore_eos=True,
                                                                    temperature=args.temperature))
            rates["1"].append(args.tokens / (time.perf_counter() - started))
            batch_tokens = args.tokens // 2
            started = time.perf_counter()
            engine.generate([prompt(rep, s + 1, vocab) for s in range(STREAMS)],
                            SamplingParams(max_tokens=batch_tokens, ignore_eos=True, temperature=args.temperature))
            rates[str(STREAMS)].append(STREAMS * batch_tokens / (time.perf_counter() - started))
    print_result({"path": engine.info().decode_step, "rates": {k: statistics.median(v) for k, v in rates.items()}})


def main() -> None:
    parser = trees_parser(__doc__, reps=2)
    parser.add_argument("--tokens", type=int, default=128, help="one stream's tokens; each of 16 streams decodes half")
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    args = parser.parse_args()
    if args.child:
        return child(args)
    trees = [tree.resolve() for tree in args.trees]
    print(f"decode, output tokens/s, median of {args.reps} runs per round (ratio to {trees[0]})")
    command = child_command(__file__, args, "--tokens", str(args.tokens), "--temperature", str(args.temperature))
    for round_, results in alternate(trees, args.rounds, command):
        base = results[trees[0]]["rates"]
        for tree in trees:
            result = results[tree]
            cells = [f"{streams} stream{'s' if streams != '1' else ''} {rate:.1f} ({rate / base[streams]:.2f}x)"
                     for streams, rate in result["rates"].items()]
            print(f"round {round_} | {tree.name or tree} ({result['path']}) | " + " | ".join(cells))


if __name__ == "__main__":
    main()
