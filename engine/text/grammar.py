"""Structured output: JSON (any object, or one JSON Schema) compiled to a grammar, and the token masks that hold
each sequence to it.

The grammar engine is llguidance. `bench/grammar.py` set it against xgrammar on the default model's 49,152-token
vocabulary (2-core AMD EPYC VM, CPU flags: avx2, no avx512; medians of 5 runs, each on a fresh compile; "features"
is the test schema: pattern, enum, const, ranges, lengths, an array, $defs/$ref, anyOf; whitespace as Tern allows
it, below; mask per token averaged over a valid instance's tokens):

| schema | llguidance 1.9.1 compile | mask per token | xgrammar 0.2.8 compile | mask per token |
|---|---|---|---|---|
| json_object | 0.5 ms | 20 us | 18 ms | 51 us |
| two properties | 0.5 ms | 19 us | 18 ms | 23 us |
| features | 1.1 ms | 53 us | 314-351 ms | 268 us (multipleOf ignored) |
| 40 properties | 1.8 ms | 12 us | 23 ms | 21 us |

plus, once per tokenizer, 0.3 s (llguidance) or 0.14 s (xgrammar) to index the vocabulary. With compact JSON (no
whitespace) xgrammar masked json_object faster (4.4 us against 15) but features slower still (546 us against 77) and
took 448 ms to compile it. Applying a mask in the sampler (unpack the bits, set the rest to -inf) brings one
constrained row to ~130 us and 16 rows to ~0.8 ms, against a decode step of ~7 ms (one stream) to ~50 ms (16) for
the default model here. Why llguidance: it compiles a schema in about a millisecond where xgrammar precomputes a
per-state token cache (a third of a second for a schema with a pattern and ranges, which then masked slower, not
faster), so a compile pause is never felt; it enforces more of JSON Schema (xgrammar 0.2.8 ignores multipleOf on
numbers) and refuses unsatisfiable schemas at compile time (a required property with minimum > maximum is a 400,
not a stuck request); and it has no dependencies, where xgrammar brings triton and apache-tvm-ffi (torch stays
2.13.0 with either).

How it fits the engine:
- GrammarCompiler compiles on the caller's thread (the API runs it in a worker thread before submit), so a slow
  schema delays only its own request; grammars are cached by schema, least recently used out first.
- A Grammar is immutable and shared by every request with the same schema; each sequence gets its own
  GrammarMatcher, a copy of the grammar's start state (~1 us).
- Each step, mask_logits sets every token the grammar does not allow at a constrained row to -inf before anything
  else: penalties, temperature, top-k/top-p and logprobs all see the masked logits. So logprobs under a grammar are
  those of the masked distribution, renormalised over the allowed tokens (an alternative the grammar forbids shows
  as -inf, which the API clamps to -9999.0). vLLM v1 does the same: its bitmask is applied to the logits before its
  sampler computes even its "raw" logprobs. Rows without a grammar are left as they are.
- A sequence finishes ("stop") once its grammar can take no more tokens (after a JSON value's closing byte); where
  it could end or go on, the mask allows the end-of-sequence tokens among the others. The grammar's end wins over
  ignore_eos and min_tokens; stop strings and max_tokens still cut the text short.
- JSON is written on one line with json.dumps's separators: `{"city": "Paris", "unit": "celsius"}`, no newlines or
  indentation. Measured on the default model at temperature 0 (2-core VM), one get_weather call (two arguments) took
  47 tokens with free whitespace (then at most 20 characters at a time; the model wrote newlines and indentation),
  37 with these separators, 32 with OpenAI's own `,` and `:`. Six response_format answers (json_object, a
  two-string schema, a person with an array; two questions each, max_tokens 100) ended by themselves in 5 of 6 with
  free whitespace, 5 of 6 with `, ` and `: `, but only 3 of 6 with `,` and `:`, where the model repeated array
  items and keys until cut (`"hobbies":["reading","writing","music","soccer","soccer",...`). Hence the spaces.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import llguidance.hf  # imports transformers: a server's start does that with the collector off (app.py)
import numpy as np
import torch

from engine.errors import GrammarError
from engine.text.tool_calls import ToolUse, grammar_source

# JSON compile options (llguidance's JsonCompileOptions, docs/json_schema.md); a schema's own "x-guidance" key may
# override them. One line of JSON, json.dumps's separators (see the module docstring).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_MAX_ERROR_CHARS = 500


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled grammar; matcher() gives a sequence its own position in it."""

    description: str  # what it was compiled from, for logs and errors: "json_object", "json_schema 'name'"
    _start: llguidance.LLMatcher  # never advanced: only copied

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._start.deep_copy())


class GrammarMatcher:
    """One sequence's position in its grammar: which tokens may come next, and whether it is complete."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill_mask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into `row`, a contiguous int32 CPU tensor of ceil(vocab / 32) words: bit
        b of word w allows token 32 * w + b."""
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def accept(self, token_id: int) -> bool:
        """Advance past token_id; False when the grammar does not allow it (the matcher is then broken for good)."""
        return self._matcher.consume_token(token_id)

    @property
    def is_finished(self) -> bool:
        """The grammar can take no more tokens (an end-of-sequence token has been taken, or the value is closed)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error().strip().splitlines()[0] if self._matcher.is_error() else ""


class GrammarCompiler:
    """Compiles response formats for one tokenizer. Thread-safe; call it off the engine thread."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: frozenset[int], max_cached: int = 256) -> None:
        self._hf_tokenizer, self._vocab_size, self._eos_ids = hf_tokenizer, vocab_size, sorted(eos_ids)
        self._max_cached = max_cached
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()  # the cache's
        self._tokenizer_lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None

    def json_object(self) -> Grammar:
        """Any one JSON object."""
        return self._cached("json_object", {"type": "object"})

    def json_schema(self, schema: dict, name: str | None = None) -> Grammar:
        """One JSON value valid against `schema`; GrammarError names what cannot be compiled."""
        if not isinstance(schema, dict):
            raise GrammarError("the schema must be a JSON object")
        return self._cached(f"json_schema {name!r}" if name else "json_schema", schema)

    def tool_calls(self, tool_use: ToolUse, answer_schema: dict | None = None) -> Grammar:
        """A reply held to tool calls in Tern's format (engine/text/tool_calls.py): free text or calls (auto), calls
        only (required), one call of one function (named). GrammarError names a parameters schema that cannot be
        compiled."""
        source = grammar_source(tool_use, answer_schema, json_options=_JSON_OPTIONS)
        return self._cached(f"tools ({tool_use.mode})", source, lark=True)

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def _cached(self, description: str, source: dict | str, lark: bool = False) -> Grammar:
        # Key order is part of the key: properties are generated in the order the schema lists them.
        key = source if lark else json.dumps(source, ensure_ascii=False)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        grammar = Grammar(description, self._compile(source, lark))
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, source: dict | str, lark: bool) -> llguidance.LLMatcher:
        try:
            if lark:
                source = llguidance.LLMatcher.grammar_from_lark(source)
            else:
                source = llguidance.LLMatcher.grammar_from_json_schema(source, defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(_short(str(exc))) from None
        matcher = llguidance.LLMatcher(self._tokenizer(), source, log_level=0)
        if matcher.is_error():
            raise GrammarError(_short(matcher.get_error()))
        return matcher

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:  # built once (~0.5 s for a 49k vocabulary), on the first request that needs it
            if self._ll_tokenizer is None:
                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos_ids)
                except ValueError as exc:  # a slow (Python) tokenizer
                    raise GrammarError(f"structured output needs a fast tokenizer: {exc}") from None
            return self._ll_tokenizer


def mask_logits(logits: torch.Tensor, matchers: list[GrammarMatcher | None]) -> torch.Tensor:
    """logits [N, V] with every token its row's grammar forbids at -inf; rows without a grammar unchanged. Returns
    the input itself when no row has a grammar, else a new tensor (the runner's may be a buffer it reuses)."""
    rows = [i for i, matcher in enumerate(matchers) if matcher is not None]
    if not rows:
        return logits
    vocab_size = logits.shape[-1]
    bitmask = torch.zeros(len(rows), (vocab_size + 31) // 32, dtype=torch.int32)
    for j, i in enumerate(rows):
        matchers[i].fill_mask(bitmask[j])
    allowed = _unpack(bitmask, vocab_size).to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0]:
        return torch.where(allowed, logits, float("-inf"))
    index = torch.tensor(rows, device=logits.device)
    masked = logits.clone()
    masked[index] = torch.where(allowed, logits[index], float("-inf"))
    return masked


def _unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 words -> [R, vocab_size] bool, bit b of word w being token 32 * w + b."""
    # numpy unpacks bits in one pass; the same in torch (shift by 0..31, and 1) made 32x bigger temporaries and
    # took milliseconds per step.
    as_bytes = bitmask.numpy().astype("<i4", copy=False).view(np.uint8)  # little-endian: bit b of byte k is 8k + b
    bits = np.unpackbits(as_bytes, axis=-1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits).view(torch.bool)


def _short(message: str) -> str:
    message = " ".join(message.split())
    return message if len(message) <= _MAX_ERROR_CHARS else message[: _MAX_ERROR_CHARS - 3] + "..."
