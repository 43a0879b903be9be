"""Engine vs transformers generate() on the same model, in one run, reported as ratios.

The engine runs in this process, generate() in a child process that this one drives, so the runs alternate;
see BaselineProcess for why they do not share one process.

    .venv/bin/python bench/engine.py [--dtype float32|bfloat16] [--tokens 128] [--reps 3]

Single stream: one request of --tokens new tokens, engine vs generate() batch 1.
16 streams: 16 requests at once through the engine, vs generate() serving them one after another (measured on
a few of them: its per-request rate does not depend on how many wait), and vs one generate() call on all 16
padded into a batch. Runs alternate (A B A B ...) and each figure is the median. Tokens/s counts generated
tokens over wall time, prompt processing included.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.config import default_cache_dir  # noqa: E402
from engine.weights import checkpoint  # noqa: E402

QUESTIONS = [
    "Tell me a story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "Write a poem about autumn leaves.",
    "What are the main causes of ocean tides?",
    "Describe a day in the life of a honeybee.",
    "How do vaccines train the immune system?",
    "Give me advice for learning to play the piano.",
    "Why is the sky blue during the day and red at sunset?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder, .gguf or hub id (default: the default model)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--quantization", default="none", help="the engine's weights (the baseline stays unquantized)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--sequential-sample", type=int, default=2, help="requests timed for the sequential baseline")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                        help="run the engine with its compiled decode step (as the server does by default)")
    args = parser.parse_args()

    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device, quantization=args.quantization,
                                 max_num_seqs=max(64, args.streams), compile=args.compile)).start()
    # transformers' baseline needs a float checkpoint: a GGUF (the default model's included) is de-quantized once.
    gguf = checkpoint.gguf_file_of(args.model)
    folder = checkpoint.dequantized_checkpoint(gguf, default_cache_dir()) if gguf else engine.loaded.folder
    baseline = BaselineProcess(folder, engine.dtype, engine.device)
    pad_id = engine.tokenizer.pad_token_id or 0
    tokenizer = engine.tokenizer
    prompts = [
        tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": q}]), add_special_tokens=False)
        for q in QUESTIONS * (args.streams // len(QUESTIONS) + 1)
    ][: args.streams]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    def engine_run(batch):
        _sync(engine.device)
        start = time.perf_counter()
        completions = engine.generate(batch, params)
        assert all(len(c.choices[0].token_ids) == args.tokens for c in completions)
        return len(batch) * args.tokens / (time.perf_counter() - start)

    def generate_run(batch):
        return baseline.run(batch, args.tokens, pad_id, one_by_one=False)

    def generate_sequential(batch):
        return baseline.run(batch[: args.sequential_sample], args.tokens, pad_id, one_by_one=True)

    engine_run(prompts[:2])  # warm-up both
    generate_run(prompts[:1])
    results = {name: [] for name in ("engine_1", "generate_1", "engine_n", "generate_sequential", "generate_padded")}
    for _ in range(args.reps):
        results["engine_1"].append(engine_run(prompts[:1]))
        results["generate_1"].append(generate_run(prompts[:1]))
        results["engine_n"].append(engine_run(prompts))
        results["generate_sequential"].append(generate_sequential(prompts))
        results["generate_padded"].append(generate_run(prompts))
    engine.stop()
    baseline.close()

    median = {name: statistics.median(values) for name, values in results.items()}
    n = args.streams
    print(f"\nmodel {engine.model_name}, {engine.dtype}, {engine.loaded.describe_weights()}, {engine.device}, {torch.get_num_threads()} threads, "
          f"{args.tokens} new tokens, median of {args.reps} alternated runs\n")
    print("| case | engine tok/s | baseline | baseline tok/s | ratio |")
    print("|---|---|---|---|---|")
    rows = [
        ("1 stream", "engine_1", "generate() batch 1", "generate_1"),
        (f"{n} streams", "engine_n", "generate() one after another", "generate_sequential"),
        (f"{n} streams", "engine_n", f"generate() {n} padded in one batch", "generate_padded"),
    ]
    for case, ours, label, base in rows:
        print(f"| {case} | {median[ours]:.1f} | {label} | {median[base]:.1f} | {median[ours] / median[base]:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"median": median, "runs": results}, indent=2))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class BaselineProcess:
    """transformers generate() in a child process, driven from this one so runs still alternate.

    Why a second process: the engine does all its torch work on its own thread, and a second thread running
    OpenMP regions in the same process (generate() on the main thread) makes libgomp throttle both threads'
    spin-waits, slowing each side by up to ~40% on 2 cores. Each side gets the process a user would run it in.
    """

    def __init__(self, folder, dtype: torch.dtype, device: torch.device) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_baseline_main, args=(child, str(folder), str(dtype), str(device)))
        self._process.start()
        assert self._conn.recv() == "ready"

    def run(self, prompts: list[list[int]], max_new_tokens: int, pad_id: int, one_by_one: bool) -> float:
        """Tokens/s of generate() on these prompts (timed in the child, so the pipe costs nothing)."""
        self._conn.send((prompts, max_new_tokens, pad_id, one_by_one))
        return self._conn.recv()

    def close(self) -> None:
        self._conn.send(None)
        self._process.join(timeout=60)


def _baseline_main(conn, folder: str, dtype: str, device: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype.removeprefix("torch.")))
    model = model.to(device).eval()
    for param in model.parameters():  # own the weights, as the engine does (an mmap-backed model is far slower)
        param.data = param.data.clone()
    model.tie_weights()
    conn.send("ready")
    while (job := conn.recv()) is not None:
        prompts, max_new_tokens, pad_id, one_by_one = job
        batches = [[p] for p in prompts] if one_by_one else [prompts]
        _sync(torch.device(device))
        start = time.perf_counter()
        for batch in batches:
            _generate(model, batch, max_new_tokens, pad_id)
        _sync(torch.device(device))
        conn.send(len(prompts) * max_new_tokens / (time.perf_counter() - start))


@torch.inference_mode()
def _generate(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int) -> None:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, prompt in enumerate(prompts):  # left padding, as generate() wants for decoder-only models
        input_ids[i, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[i, width - len(prompt) :] = 1
    model.generate(
        input_ids.to(model.device),
        attention_mask=attention_mask.to(model.device),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
    )


if __name__ == "__main__":
    main()
