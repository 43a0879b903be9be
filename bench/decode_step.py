"""One decode step of the engine, timed alone: graph-replayed (or compiled) step vs the eager step, same run.

    python bench/decode_step.py --model /tmp/llama-1b --device cuda --dtype bfloat16 --batch 1 16 64
    python bench/decode_step.py --device cuda --dtype bfloat16 --no-cuda-graphs --compile   # compiled, uncaptured

For each batch size: milliseconds per step (sequences of --context tokens each, every one adding a token),
tokens/s, and the weights' bytes over the step time as a rate, against --bandwidth (GB/s; the issue's 3,000 for
an H100). At batch 1 that rate over the bandwidth is how close decode is to the memory limit. The step is the
model (lm_head included) only: no scheduling, sampling or detokenizing, which bench/engine.py counts.

Made for GPUs. On a CPU its figures are pessimistic (~30% on 2 cores): it calls the model from this thread
while the engine's own thread holds an OpenMP team, and libgomp then throttles both (see engine/engine.py);
bench/engine.py measures the CPU engine as it serves.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import Engine, EngineConfig  # noqa: E402
from engine.decode.compiled import WarmupSequence  # noqa: E402
from engine.decode.runner import ModelRunner  # noqa: E402
from engine.scheduler import ScheduledBatch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder, .gguf or hub id (default: the default model)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=200, help="tokens each sequence already has")
    parser.add_argument("--steps", type=int, default=50, help="steps per timing; the median of --reps timings")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--bandwidth", type=float, default=3000.0, help="memory bandwidth in GB/s to compare with")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the engine says what it chose

    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device, compile=args.compile,
                                 quantization=args.quantization, cuda_graphs=args.cuda_graphs,
                                 max_num_seqs=max(args.batch)))
    engine.wait_for_compiled_decode(timeout_s=1800)  # on CPU it builds in the background: time the steady state
    runner, device = engine.runner, engine.device
    # The eager twin: a runner on the same model and cache whose decode steps take the eager model.
    eager_path = dataclasses.replace(runner.path, step="eager", graphs=False, kernels=None)
    eager_runner = ModelRunner(runner.model, runner.kv_cache, device, eager_path, engine.allocator,
                               engine.config.max_num_seqs, engine.max_model_len)
    weight_bytes = engine.loaded.weight_bytes
    fast = "CUDA graphs" if engine.info().decode_graphs else engine.info().decode_step
    blocks_per_seq = -(-(args.context + 1) // engine.kv_cache.block_size)
    print(f"\nmodel {engine.model_name}, {engine.dtype}, {engine.loaded.describe_weights()}, {device}, "
          f"context {args.context}, {fast} step vs eager step, median of {args.reps} x {args.steps} steps\n")
    print("| batch | step | ms/step | tok/s | weights GB/s | of bandwidth | eager ms/step | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in args.batch:
        seqs = [WarmupSequence([0] * (args.context + 1), args.context,
                               list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))) for i in range(batch)]
        scheduled = ScheduledBatch(seqs, [1] * batch, samples=[True] * batch, wants_prompt_logits=[False] * batch)

        timings = {name: _time(lambda r=r: r.run(scheduled), device, args.steps, args.reps)
                   for name, r in (("fast", runner), ("eager", eager_runner))}
        ms, eager_ms = timings["fast"] * 1e3, timings["eager"] * 1e3
        rate = weight_bytes / timings["fast"] / 1e9
        print(f"| {batch} | {fast} | {ms:.3f} | {batch / timings['fast']:.0f} | {rate:.0f} | "
              f"{rate / args.bandwidth:.0%} | {eager_ms:.3f} | {eager_ms / ms:.2f}x |")


def _time(step, device: torch.device, steps: int, reps: int) -> float:
    """Median seconds per step."""
    for _ in range(3):
        step()
    results = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        _sync(device)
        results.append((time.perf_counter() - start) / steps)
    return statistics.median(results)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
