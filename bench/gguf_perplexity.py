"""Perplexity of GGUF files through Tern and through llama.cpp's own `llama-perplexity`, scored the same way.

    ../shared/tools/llama_server.sh        # builds llama.cpp once; then in its build folder:
    cmake --build build --target llama-perplexity
    .venv/bin/python bench/gguf_perplexity.py --llama-bin ~/.cache/llama-cpp-src/llama.cpp/build/bin \
        [FILE.gguf ...]                     # no file: the default model

Text: CPython's LICENSE.txt (from this interpreter's stdlib), as engine/README.md's other perplexities. Method: llama.cpp's
(tools/perplexity): the text's tokens (BOS first where the file says to add one) cut into --chunks chunks of --ctx
tokens, each evaluated from an empty cache with its first token replaced by BOS, and only the second half of each
chunk scored, so every scored token has at least ctx/2 tokens before it. Tern's numbers come from its prompt
logprobs (`Engine.generate` with prompt_logprobs), once under `--quantization auto` (how the server serves the file)
and once under `none` in float32 (the file's values de-quantized: no activation quantization), which separates
what Tern's kernels lose from what the file's quantization loses.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import gguf

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# bench/ after the root: bench/engine.py must not shadow the engine package
sys.path.append(str(Path(__file__).resolve().parent))

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.weights.checkpoint import default_gguf_path  # noqa: E402
from rounds import kernel_flags  # noqa: E402

TEXT = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"


def adds_bos(model: Path) -> bool:
    """Whether the file's tokenizer adds BOS (llama.cpp's default when unsaid: yes)."""
    field = gguf.GGUFReader(model).get_field("tokenizer.ggml.add_bos_token")
    return True if field is None else bool(field.contents())


def llama_perplexity(llama_bin: Path, model: Path, ctx: int, chunks: int) -> float:
    env = dict(os.environ, LD_LIBRARY_PATH=str(llama_bin))
    result = subprocess.run(
        [str(llama_bin / "llama-perplexity"), "-m", str(model), "-f", str(TEXT), "-c", str(ctx), "-b", str(ctx),
         "--chunks", str(chunks), "-t", "2"],
        capture_output=True, text=True, env=env, check=True)
    match = re.search(r"Final estimate: PPL = ([0-9.]+)", result.stdout + result.stderr)
    if match is None:
        raise RuntimeError(f"llama-perplexity printed no estimate:\n{result.stderr[-2000:]}")
    return float(match.group(1))


def chunks_of(engine: Engine, add_bos: bool, ctx: int, chunks: int) -> list[list[int]]:
    """llama.cpp's chunks: the whole text tokenized (BOS first if the file adds one), cut every `ctx` tokens, and
    each chunk's first token replaced by BOS."""
    tokenizer = engine.loaded.tokenizer
    ids = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    if add_bos:
        ids = [tokenizer.bos_token_id] + ids
    if len(ids) < chunks * ctx:
        raise SystemExit(f"{TEXT} gives {len(ids)} tokens, fewer than {chunks} chunks of {ctx}")
    out = [ids[i * ctx:(i + 1) * ctx] for i in range(chunks)]
    if add_bos:
        for chunk in out:
            chunk[0] = tokenizer.bos_token_id
    return out


class LastMessage(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        self.message = record.getMessage()


def tern_perplexity(model: Path, quantization: str, dtype: str, add_bos: bool, ctx: int,
                    chunks: int) -> tuple[float, str]:
    """Tern's perplexity, and what served each tensor type (the loader's summary line, e.g. "112 Q4_0 as q4")."""
    served = LastMessage()
    logging.getLogger("engine.weights.streamed_load").addHandler(served)
    logging.getLogger("engine.weights.streamed_load").setLevel(logging.INFO)
    engine = Engine(EngineConfig(model=str(model), quantization=quantization, dtype=dtype, max_model_len=ctx + 8,
                                 compile=False)).start()
    try:
        nll, count = 0.0, 0
        for chunk in chunks_of(engine, add_bos, ctx, chunks):
            [completion] = engine.generate([chunk], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
            scored = completion.prompt_logprobs[ctx // 2 + 1:]  # entry j: log p(token j | tokens before j)
            nll -= sum(entry.logprob for entry in scored)
            count += len(scored)
        return math.exp(nll / count), served.message.split(": ", 1)[-1]
    finally:
        engine.stop()
        logging.getLogger("engine.weights.streamed_load").removeHandler(served)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", type=Path)
    parser.add_argument("--llama-bin", type=Path, help="folder holding llama-perplexity (left out: Tern only)")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=2)
    args = parser.parse_args()
    models = args.models or [default_gguf_path()]
    rows = []
    for model in models:
        started = time.perf_counter()
        add_bos = adds_bos(model)
        served, described = tern_perplexity(model, "auto", "auto", add_bos, args.ctx, args.chunks)
        plain, _ = tern_perplexity(model, "none", "float32", add_bos, args.ctx, args.chunks)
        llama = llama_perplexity(args.llama_bin, model, args.ctx, args.chunks) if args.llama_bin else float("nan")
        rows.append(f"| {model.name} | {model.stat().st_size / 1e6:.0f} | {described} | {served:.3f} | {plain:.3f} "
                    f"| {llama:.3f} | {served / llama:.4f} |")
        print(rows[-1], f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    print(f"\nCPU flags: {kernel_flags()}; {TEXT.name}, {args.chunks} chunks of {args.ctx} tokens, the second half of "
          f"each scored\n")
    print("| File | MB | Tern `auto` serves | Tern `auto` | Tern `none` fp32 | llama-perplexity "
          "| Tern/llama |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
