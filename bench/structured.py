"""What structured output costs a shared batch: 16 streams where half ask for a json_schema reply, against 16 free
streams, on one engine configured as `make run` configures it (the default model, --quantization auto).

    .venv/bin/python bench/structured.py [--streams 16] [--seconds 30] [--rounds 2] [--quantization auto]
        [--no-compile] [--json out.json]

Each of --streams clients sends chat requests back to back for --seconds, so the batch stays full. Every request
asks for exactly --max-tokens tokens at temperature 1: free ones with ignore_eos, constrained ones with a schema whose
shortest valid value (12 birds) is longer than that, so both kinds run the same length and the rounds differ only in
the grammar. Rounds alternate, free then mixed, then mixed then free, and so on; the ratio is taken within a round.

Reported per run: generated tokens/s over all streams (and of the constrained half), the ratio mixed / free, and
the grammar's own time per step on the engine thread: computing and applying the masks (engine.text.grammar.mask_logits)
and advancing each sequence's matcher past its new token (GrammarMatcher.accept), timed by wrapping both.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine import sampler  # noqa: E402
from engine.text import grammar  # noqa: E402

BIRDS = {
    "type": "object",
    "properties": {
        "birds": {
            "type": "array",
            "minItems": 12,
            "maxItems": 12,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "wingspan_cm": {"type": "integer", "minimum": 5, "maximum": 400},
                    "migrates": {"type": "boolean"},
                },
                "required": ["name", "wingspan_cm", "migrates"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["birds"],
    "additionalProperties": False,
}


class GrammarClock:
    """Seconds the engine thread spends in the grammar: masks (mask_logits) and matcher advances (accept)."""

    def __init__(self) -> None:
        self.mask_s = self.accept_s = 0.0
        mask_logits, accept = grammar.mask_logits, grammar.GrammarMatcher.accept
        clock = self

        def timed_mask(logits, matchers):
            started = time.perf_counter()
            try:
                return mask_logits(logits, matchers)
            finally:
                clock.mask_s += time.perf_counter() - started

        def timed_accept(matcher, token_id):
            started = time.perf_counter()
            try:
                return accept(matcher, token_id)
            finally:
                clock.accept_s += time.perf_counter() - started

        sampler.mask_logits = timed_mask  # the sampler calls it by this name
        grammar.GrammarMatcher.accept = timed_accept


async def run_round(engine: Engine, streams: int, constrained: int, seconds: float, max_tokens: int,
                    schema_grammar, clock: GrammarClock, round_index: int) -> dict:
    """`streams` clients for `seconds`, the first `constrained` of them asking for the schema."""
    free = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    held = SamplingParams(temperature=1.0, max_tokens=max_tokens, grammar=schema_grammar)
    tokens = [0] * streams
    deadline = time.monotonic() + seconds
    before = engine.stats()
    clock.mask_s = clock.accept_s = 0.0

    async def client(index: int) -> None:
        number = 0
        while time.monotonic() < deadline:
            question = (f"Describe bird number {index * 1000 + number} as JSON." if index < constrained
                        else f"Tell me a story about bird number {index * 1000 + number}.")
            prompt = engine.tokenizer.chat_prompt_ids([{"role": "user", "content": f"Round {round_index}. {question}"}])
            stream = engine.submit(prompt, held if index < constrained else free)
            async for out in stream:
                tokens[index] += len(out.token_ids)
            number += 1

    started = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(streams)))
    elapsed = time.monotonic() - started
    after = engine.stats()
    steps = after.num_steps - before.num_steps
    return {
        "constrained_streams": constrained,
        "seconds": elapsed,
        "tokens_per_s": sum(tokens) / elapsed,
        "constrained_tokens_per_s": sum(tokens[:constrained]) / elapsed,
        "steps": steps,
        "grammar_mask_ms_per_step": 1000 * clock.mask_s / max(steps, 1),
        "grammar_accept_ms_per_step": 1000 * clock.accept_s / max(steps, 1),
        "step_ms": 1000 * elapsed / max(steps, 1),
    }


async def main_async(args) -> dict:
    clock = GrammarClock()
    # The server's defaults (app.py): --quantization auto, --compile.
    engine = Engine(EngineConfig(quantization=args.quantization, compile=args.compile)).start()
    try:
        engine.wait_for_compiled_decode(timeout_s=1800)  # measure the steady state, not the eager stand-in
        schema_grammar = engine.grammars.json_schema(BIRDS, "birds")
        half = args.streams // 2
        await run_round(engine, args.streams, half, 5, args.max_tokens, schema_grammar, clock, -1)  # warm-up
        rounds = []
        for r in range(args.rounds):
            order = [0, half] if r % 2 == 0 else [half, 0]
            results = {}
            for constrained in order:
                results[constrained] = await run_round(engine, args.streams, constrained, args.seconds,
                                                       args.max_tokens, schema_grammar, clock, r)
            rounds.append({"free": results[0], "mixed": results[half],
                           "ratio": results[half]["tokens_per_s"] / results[0]["tokens_per_s"]})
        return {
            "cpu": _cpu_flags(), "machine": platform.machine(), "quantization": engine.loaded.quantization,
            "dtype": str(engine.dtype), "decode_step": engine.info().decode_step, "streams": args.streams,
            "max_tokens": args.max_tokens, "seconds": args.seconds, "rounds": rounds,
            "median_ratio": statistics.median(r["ratio"] for r in rounds),
        }
    finally:
        engine.stop()


def _cpu_flags() -> str:
    try:
        flags = set(re.findall(r"\b(avx512\w*|avx2|fma|avx_vnni)\b", Path("/proc/cpuinfo").read_text()))
    except OSError:
        return "unknown"
    return " ".join(sorted(flags))


def _table(report: dict) -> str:
    lines = [
        f"CPU flags: {report['cpu']}",
        f"engine: {report['quantization']} {report['dtype']}, decode step {report['decode_step']}; "
        f"{report['streams']} streams x {report['max_tokens']} tokens, {report['seconds']:g} s per measurement",
        "",
        "| round | free tok/s | mixed tok/s (constrained half) | mixed / free | grammar mask ms/step | "
        "accept ms/step | step ms (free, mixed) |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(report["rounds"]):
        free, mixed = r["free"], r["mixed"]
        lines.append(
            f"| {i + 1} | {free['tokens_per_s']:.1f} | {mixed['tokens_per_s']:.1f} "
            f"({mixed['constrained_tokens_per_s']:.1f}) | {r['ratio']:.3f} | {mixed['grammar_mask_ms_per_step']:.2f} | "
            f"{mixed['grammar_accept_ms_per_step']:.3f} | {free['step_ms']:.1f}, {mixed['step_ms']:.1f} |")
    lines.append(f"\nmedian mixed / free: {report['median_ratio']:.3f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--quantization", default="auto", help="as the server's flag (default auto, as make run)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    print(_table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
