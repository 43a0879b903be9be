"""Write a random-weight Llama checkpoint of a named size, for speed runs where real weights do not matter.

    python bench/random_checkpoint.py llama-1b /tmp/llama-1b --tokenizer ~/.cache/tern/models/<default>

Speed depends on the shapes only, so a random checkpoint stands in for a real 1B model on a machine that cannot
download one. The tokenizer (any Hugging Face tokenizer folder) sets the vocabulary size.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

# Run as a script, this folder comes first on sys.path, and bench/kernels.py then shadows the `kernels` package that
# transformers tries to import (it fails in a circular import). Nothing here imports from this folder.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

SIZES = {
    # A few MB, loads in about a second: for tests and benchmarks of what sits around the engine (routing, Ray)
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False),
    # SmolLM2-135M's shapes (the default model)
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, tie_word_embeddings=True),
    # Llama-3.2-1B's shapes (with the tokenizer's vocabulary)
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, tie_word_embeddings=True),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def make_random_checkpoint(size: str, tokenizer_folder: Path, out: Path, dtype=torch.bfloat16) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=4096, rope_theta=100000.0,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **SIZES[size])
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_folder) / name).exists():
            shutil.copy(Path(tokenizer_folder) / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("size", choices=sorted(SIZES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokenizer", type=Path, required=True)
    args = parser.parse_args()
    print(make_random_checkpoint(args.size, args.tokenizer, args.out))


if __name__ == "__main__":
    main()
