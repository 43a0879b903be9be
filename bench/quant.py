"""Every quantization mode in one run: weight memory, perplexity and decode speed, as one markdown table.

    .venv/bin/python bench/quant.py [--dtype auto|float32|bfloat16] [--tokens 32] [--streams 16] [--modes ...]

Perplexity: the first 1,024 tokens of CPython's LICENSE.txt (from this interpreter's stdlib), scored through the
engine's prompt logprobs. Decode: one request, then --streams requests at once, each of --tokens greedy tokens
(EOS ignored); tokens/s counts generated tokens over wall time, prompt processing included, median of --reps.
Modes this machine cannot run are listed with the reason instead of numbers.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.weights import quant  # noqa: E402
from engine.weights.loader import choose_device, choose_dtype  # noqa: E402


def _bench_engine_module():
    """bench/engine.py (its prompts and sync helper); loaded by path, since its name shadows the engine package."""
    spec = importlib.util.spec_from_file_location("bench_engine", Path(__file__).with_name("engine.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder, .gguf or hub id (default: the default model)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--modes", nargs="+", default=list(quant.MODES), choices=quant.MODES)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                        help="run the engine with its compiled decode step (as the server does by default)")
    args = parser.parse_args()
    bench_engine = _bench_engine_module()

    device = choose_device(args.device)
    dtype = choose_dtype(args.dtype, device)
    rows, model_name = [], args.model or "the default model"
    for mode in args.modes:
        reason = quant.unsupported_reason(mode, device, dtype)
        if reason:
            rows.append(f"| {mode} | - | - | - | - | - | {reason} |")
            continue
        config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, quantization=mode,
                              max_num_seqs=max(args.streams, 1), max_model_len=2048,
                              compile=args.compile)
        engine = Engine(config).start()
        model_name = engine.model_name
        try:
            perplexity = _perplexity(engine)
            prompts = _chat_prompts(engine, bench_engine.QUESTIONS, args.streams)
            single = _decode_rate(engine, prompts[:1], args.tokens, args.reps, bench_engine._sync)
            many = _decode_rate(engine, prompts, args.tokens, args.reps, bench_engine._sync)
            loaded = engine.loaded
            ratio = loaded.weight_bytes / loaded.bf16_weight_bytes
            rows.append(f"| {mode} | {loaded.weight_bytes / 1e6:.0f} | {ratio:.2f}x | {perplexity:.2f} | "
                        f"{single:.1f} | {many:.1f} | |")
            print(rows[-1], file=sys.stderr, flush=True)  # progress: 4-bit modes are slow on CPU
        finally:
            engine.stop()

    print(f"\nmodel {model_name}, compute {str(dtype).removeprefix('torch.')}, {device}, "
          f"{torch.get_num_threads()} threads, {args.tokens} new tokens per stream, median of {args.reps}\n")
    print(f"| mode | weight MB | vs bf16 | perplexity | 1-stream tok/s | {args.streams}-stream tok/s | note |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


def _perplexity(engine: Engine, num_tokens: int = 1024) -> float:
    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    ids = engine.tokenizer.encode(text)[:num_tokens]
    [completion] = engine.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    logprobs = [entry.logprob for entry in completion.prompt_logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs))


def _chat_prompts(engine: Engine, questions: list[str], count: int) -> list[list[int]]:
    tokenizer = engine.tokenizer
    rendered = [tokenizer.render_chat([{"role": "user", "content": q}]) for q in questions]
    return [tokenizer.encode(rendered[i % len(rendered)], add_special_tokens=False) for i in range(count)]


def _decode_rate(engine: Engine, prompts: list[list[int]], tokens: int, reps: int, sync) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
    rates = []
    for _ in range(reps):
        sync(engine.device)
        start = time.perf_counter()
        engine.generate(prompts, params)
        sync(engine.device)
        rates.append(len(prompts) * tokens / (time.perf_counter() - start))
    return statistics.median(rates)


if __name__ == "__main__":
    main()
