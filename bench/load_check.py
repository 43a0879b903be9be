"""What an operator checks when a big model is first served: Tern started as a user starts it, on each model given.

    .venv/bin/python bench/load_check.py /work/models/llama8b/model-Q4_K_M.gguf /work/models/llama8b/hf

Per model (a GGUF file or a Hugging Face folder), `python app.py --model MODEL` with no other flag, alone on the
machine: seconds to ready (/health 200 with the step that will serve), resident memory at ready (VmHWM: the peak of
loading; VmRSS, once the KV pool has faulted in), the mode and weight bytes the server reports on /v1/models, one
chat answer (greedy), one stream's decode rate, and the peak after those requests. The memory bars of issue 25:
- a GGUF: peak while loading within 1.3x of the file plus the KV pool, resident at ready within 1.15x;
- a folder: peak while loading within the served weights plus its largest tensor in float32 plus the KV pool.
Printed as ratios, with what the server holds beyond those (Python, torch and the server's own code).
127.0.0.1 only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf_servers import Server, memory_mb, read_through  # noqa: E402
from rounds import kernel_flags  # noqa: E402

MIB = 2**20


def largest_tensor_fp32_bytes(folder: Path) -> int:
    """The largest tensor of a safetensors folder, as float32: what a tensor-by-tensor load holds besides its
    output (read from the files' headers only)."""
    from safetensors import safe_open

    largest = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                numel = 1
                for size in handle.get_slice(name).get_shape():
                    numel *= size
                largest = max(largest, numel * 4)
    return largest


def file_bytes(model: Path) -> int:
    if model.is_dir():
        return sum(f.stat().st_size for f in model.glob("*.safetensors"))
    return model.stat().st_size


def answer(base: str, prompt: str, max_tokens: int) -> tuple[str, float, int]:
    """One greedy chat completion: its text, seconds, and completion tokens."""
    started = time.perf_counter()
    response = httpx.post(f"{base}/v1/chat/completions", timeout=900, json={
        "model": httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"],
        "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0})
    response.raise_for_status()
    body = response.json()
    return body["choices"][0]["message"]["content"], time.perf_counter() - started, body["usage"]["completion_tokens"]


def check(model: Path, args) -> dict:
    if model.is_file():
        read_through(model)  # in the page cache, as for gguf_servers' starts
    server = Server("tern", model, Path("."), 1, args.log_dir)
    try:
        card = httpx.get(f"{server.base}/v1/models", timeout=10).json()["data"][0]
        text, seconds, tokens = answer(server.base, "What is the capital of France?", 16)
        one = server.sweep(1, prompt_tokens=100, max_tokens=args.max_tokens)
    finally:
        after = server.stop()
    kv = card["kv_cache_bytes"] / MIB
    weights = card["weight_bytes"] / MIB
    result = dict(model=str(model), kernels=server.kernels, ready_s=round(server.ready_s, 1),
                  quantization=card["quantization"], weights_mib=round(weights), kv_mib=round(kv),
                  file_mib=round(file_bytes(model) / MIB), load_peak_mib=round(server.at_ready["VmHWM"]),
                  ready_mib=round(server.at_ready["VmRSS"]), peak_after_mib=round(after["VmHWM"]),
                  answer=text, answer_tokens=tokens, answer_s=round(seconds, 2),
                  one_stream_tok_s=round(one["output_tok_s"], 2),
                  one_stream_decode_tok_s=round(one["stream_decode_tok_s"], 2))
    if model.is_dir():
        largest = largest_tensor_fp32_bytes(model) / MIB
        bound = weights + largest + kv
        result.update(largest_tensor_fp32_mib=round(largest), load_bound_mib=round(bound),
                      load_peak_over_bound=round(result["load_peak_mib"] / bound, 3),
                      beyond_bound_mib=round(result["load_peak_mib"] - bound))
    else:
        base = result["file_mib"] + kv
        result.update(load_peak_over_file_kv=round(result["load_peak_mib"] / base, 3),
                      ready_over_file_kv=round(result["ready_mib"] / base, 3),
                      beyond_file_kv_mib=round(result["ready_mib"] - base))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request of the one-stream run")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    print(f"CPU flags: {kernel_flags()}; {os.cpu_count()} cores", flush=True)
    for model in args.models:
        print(json.dumps(check(model, args), indent=1), flush=True)


if __name__ == "__main__":
    main()
