"""Grammar engines for structured output, side by side: schema compile time and per-token mask time.

    .venv/bin/python bench/grammar.py                       # llguidance, as Tern uses it (engine/text/grammar.py)
    pip install --no-deps --target /tmp/xgr xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
    PYTHONPATH=/tmp/xgr .venv/bin/python bench/grammar.py   # both (xgrammar's triton dependency is not needed on CPU)

For each schema: the time to compile it (first compile: nothing cached), then the time to compute one token mask
over the default model's 49,152-token vocabulary, averaged over the tokens of a valid instance (JSON indented by 2,
as the default model writes it) as the tokenizer splits it (mask, then consume the token, as a decode step does).
Both allow whitespace between JSON tokens, at most 20 characters at a time. Medians of --reps runs. Last, what
applying a mask to one row of logits costs Tern's sampler (engine.text.grammar.mask_logits, one torch thread).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import default_cache_dir  # noqa: E402
from engine.weights.checkpoint import resolve_checkpoint  # noqa: E402

SCHEMAS: dict[str, tuple[dict, object]] = {
    "json_object": ({"type": "object"}, {"name": "Ada", "tags": ["x", 1, None, True], "nested": {"k": 2.5}}),
    "small": (
        {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
         "required": ["name", "age"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36},
    ),
    "features": (
        {
            "type": "object",
            "$defs": {"point": {"type": "object",
                                "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.25},
                                               "y": {"type": "integer", "minimum": -99, "maximum": 99}},
                                "required": ["x", "y"], "additionalProperties": False}},
            "properties": {
                "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "kind": {"enum": ["bird", "fish", "mammal"]},
                "version": {"const": 2},
                "count": {"type": "integer", "minimum": 1, "maximum": 99},
                "name": {"type": "string", "minLength": 2, "maxLength": 12},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
                "origin": {"$ref": "#/$defs/point"},
                "note": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
            },
            "required": ["id", "kind", "version", "count", "name", "tags", "origin", "note"],
            "additionalProperties": False,
        },
        {"id": "ABC-1234", "kind": "bird", "version": 2, "count": 7, "name": "Tern", "tags": ["sea", "white"],
         "origin": {"x": 1.25, "y": -3}, "note": None},  # tests/engine/text/test_grammar.py's FEATURES
    ),
    "wide (40 props)": (
        {"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer", "boolean"]} for i in range(40)},
         "required": [f"field_{i}" for i in range(40)], "additionalProperties": False},
        {f"field_{i}": (i if i % 3 == 0 else "v" if i % 3 == 1 else True) for i in range(40)},
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    folder, _ = resolve_checkpoint(None, default_cache_dir())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab_size = len(tokenizer)
    backends = [b for b in (_llguidance(tokenizer, vocab_size), _xgrammar(tokenizer, vocab_size)) if b]
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = sorted(set(re.findall(r"\bavx512\w*|\bavx2\b", cpuinfo)))
    print(f"vocabulary {vocab_size} tokens; CPU flags: {' '.join(flags) or 'n/a'}")
    print(f"{'engine':<18} {'schema':<16} {'tokenizer init':>15} {'compile':>10} {'mask/token':>12} {'tokens':>7}")
    for name, setup in backends:
        start = time.perf_counter()
        compile_fn, mask_fn = setup()
        init_s = time.perf_counter() - start
        for schema_name, (schema, instance) in SCHEMAS.items():
            token_ids = tokenizer.encode(json.dumps(instance, indent=2), add_special_tokens=False)
            compile_times, mask_times = [], []
            for rep in range(args.reps):
                # A schema differing in its title each rep, so that no compile cache answers.
                variant = {**schema, "title": f"rep{rep}-{time.time_ns()}"}
                start = time.perf_counter()
                grammar = compile_fn(variant)
                compile_times.append(time.perf_counter() - start)
                mask_times.append(mask_fn(grammar, token_ids))
            compile_ms = statistics.median(compile_times) * 1e3
            print(f"{name:<18} {schema_name:<16} {init_s * 1e3:>12.0f} ms {compile_ms:>7.1f} ms"
                  f" {statistics.median(mask_times) * 1e6:>9.1f} us {len(token_ids):>7}")
            init_s = 0.0
    _apply_cost(tokenizer, vocab_size, args.reps)


def _apply_cost(tokenizer, vocab_size: int, reps: int) -> None:
    from engine.text.grammar import GrammarCompiler, mask_logits

    grammar = GrammarCompiler(tokenizer, vocab_size, frozenset({tokenizer.eos_token_id})).json_object()
    for rows in (1, 16):
        logits, matchers = torch.randn(rows, vocab_size), [grammar.matcher() for _ in range(rows)]
        times = []
        for _ in range(max(reps, 5)):
            start = time.perf_counter()
            mask_logits(logits, matchers)
            times.append(time.perf_counter() - start)
        print(f"mask_logits, {rows} constrained rows (masks + unpack + apply): {statistics.median(times) * 1e6:.0f} us")


def _llguidance(tokenizer, vocab_size):
    import llguidance

    from engine.text.grammar import GrammarCompiler

    def setup():
        compiler = GrammarCompiler(tokenizer, vocab_size, frozenset({tokenizer.eos_token_id}))
        compiler.json_object()  # builds the tokenizer index (the "tokenizer init" column)

        def compile_fn(schema):
            return compiler.json_schema(schema)

        def mask_fn(grammar, token_ids):
            matcher = grammar.matcher()
            bitmask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
            elapsed = 0.0
            for token_id in token_ids:
                start = time.perf_counter()
                matcher.fill_mask(bitmask)
                elapsed += time.perf_counter() - start
                assert matcher.accept(token_id), matcher.error
            return elapsed / len(token_ids)

        return compile_fn, mask_fn

    return f"llguidance {llguidance.__version__}", setup


def _xgrammar(tokenizer, vocab_size):
    try:
        import xgrammar
    except ImportError:
        return None

    def setup():
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

        def compile_fn(schema):
            return compiler.compile_json_schema(json.dumps(schema), any_whitespace=True, max_whitespace_cnt=20)

        def mask_fn(grammar, token_ids):
            matcher = xgrammar.GrammarMatcher(grammar)
            bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
            elapsed = 0.0
            for token_id in token_ids:
                start = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                elapsed += time.perf_counter() - start
                assert matcher.accept_token(token_id)
            return elapsed / len(token_ids)

        return compile_fn, mask_fn

    import importlib.metadata

    return f"xgrammar {importlib.metadata.version('xgrammar')}", setup


if __name__ == "__main__":
    main()
