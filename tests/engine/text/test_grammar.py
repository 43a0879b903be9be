"""Structured output in the engine: a grammar's mask holds every token, for a random model too, in any batch."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine import GrammarError, SamplingParams
from engine.text.grammar import GrammarCompiler, mask_logits

PROMPT = [1, 9707, 28, 3060, 30]
# Every feature the issue names: required, enum, const, integer and number ranges, a string pattern and lengths,
# an array with min/max items, a nested object through $defs/$ref, anyOf. Bounded everywhere (a number's digits by
# multipleOf), so that a random model, greedy too, cannot write forever.
FEATURES = {
    "type": "object",
    "$defs": {
        "point": {
            "type": "object",
            "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.25},
                           "y": {"type": "integer", "minimum": -99, "maximum": 99}},
            "required": ["x", "y"],
            "additionalProperties": False,
        }
    },
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
}


@pytest.fixture
def tiny(tiny_engine_factory):
    engine, _ = tiny_engine_factory()
    return engine


def _choice(engine, params: SamplingParams, prompt=PROMPT):
    return engine.generate([prompt], params)[0].choices[0]


def _chat_prompt(engine, messages: list[dict]) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.render_chat(messages), add_special_tokens=False)


def _accepts(engine, grammar, token_ids: list[int]) -> bool:
    """Whether a fresh matcher takes these tokens: the output is (the start of) something the grammar allows."""
    matcher = grammar.matcher()
    return all(matcher.accept(t) for t in token_ids)


# The guarantee, on a random model.
@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 0.0},
        {"temperature": 1.0, "n": 3},
        # Truncation and penalties act on the masked logits; a bias of +100 on a token cannot get it past the mask.
        {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.02, "repetition_penalty": 1.3,
         "frequency_penalty": 1.0, "logit_bias": {504: 100.0, 2: 100.0}},
    ],
    ids=["greedy", "sampled", "truncated-penalised-biased"],
)
def test_a_random_model_writes_json_valid_against_the_schema(tiny, options):
    grammar = tiny.grammars.json_schema(FEATURES, "features")
    params = SamplingParams(max_tokens=400, grammar=grammar, seed=7, **options)
    completion = tiny.generate([PROMPT], params)[0]
    for choice in completion.choices:
        assert choice.finish_reason == "stop" and choice.stop_reason is None, choice.text
        value = json.loads(choice.text)
        jsonschema.validate(value, FEATURES)
        # One line, json.dumps's separators: outside strings, no whitespace but the space after each , and :
        outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', choice.text).replace(", ", ",").replace(": ", ":")
        assert not any(c.isspace() for c in outside_strings)
        assert choice.token_ids[-1] not in tiny.tokenizer.eos_ids  # ended by the grammar, one token early


def test_a_random_model_under_json_object_writes_an_object_or_its_start(tiny):
    grammar = tiny.grammars.json_object()
    completions = tiny.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=64, grammar=grammar, n=8, seed=3))
    for choice in completions[0].choices:
        assert choice.text.startswith("{") and _accepts(tiny, grammar, choice.token_ids)
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict)
        else:  # cut by max_tokens: the start of an object
            assert choice.finish_reason == "length" and len(choice.token_ids) == 64


def test_max_tokens_that_cuts_the_json_short_is_length(tiny):
    grammar = tiny.grammars.json_schema(FEATURES)
    choice = _choice(tiny, SamplingParams(temperature=0, max_tokens=5, grammar=grammar))
    assert choice.finish_reason == "length" and len(choice.token_ids) == 5
    assert choice.text.startswith("{") and _accepts(tiny, grammar, choice.token_ids)


def test_the_grammar_ends_the_sequence_even_against_min_tokens_and_ignore_eos(tiny):
    grammar = tiny.grammars.json_schema({"enum": ["yes"]})
    for params in (SamplingParams(temperature=0, max_tokens=50, min_tokens=20, grammar=grammar),
                   SamplingParams(temperature=1.0, max_tokens=50, ignore_eos=True, grammar=grammar, seed=1)):
        choice = _choice(tiny, params)
        assert (choice.text, choice.finish_reason) == ('"yes"', "stop")


def test_stop_strings_still_cut_the_text(tiny):
    schema = {"type": "object", "properties": {"kind": {"const": "bird"}}, "required": ["kind"]}
    grammar = tiny.grammars.json_schema(schema)
    choice = _choice(tiny, SamplingParams(temperature=0, max_tokens=50, stop=["bird"], grammar=grammar))
    assert (choice.finish_reason, choice.stop_reason) == ("stop", "bird")
    assert choice.text == '{"kind": "'  # one layout: json.dumps's


# Batches.
def test_free_rows_beside_constrained_ones_get_the_same_tokens_as_alone(tiny):
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, ignore_eos=True, seed=11)
    constrained = SamplingParams(temperature=0, max_tokens=200, grammar=tiny.grammars.json_schema(FEATURES))
    prompts = [PROMPT, [1, 504, 3458, 314], [1, 7, 8]]
    alone_free = [_choice(tiny, free, p).token_ids for p in prompts]
    alone_seeded = _choice(tiny, seeded, prompts[1]).token_ids
    alone_constrained = _choice(tiny, constrained).token_ids
    streams = [tiny.submit(PROMPT, constrained)]
    streams += [tiny.submit(p, free) for p in prompts]
    streams.append(tiny.submit(prompts[1], seeded))
    together = [[t for out in stream for t in out.token_ids] for stream in streams]
    assert together == [alone_constrained, *alone_free, alone_seeded]


def test_each_of_n_samples_follows_its_own_position_in_the_grammar(tiny):
    grammar = tiny.grammars.json_schema({"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 4})
    params = SamplingParams(temperature=1.0, max_tokens=60, n=6, seed=5, grammar=grammar)
    completion = tiny.generate([PROMPT], params)[0]
    texts = [c.text for c in completion.choices]
    assert len(set(texts)) > 1  # they did diverge
    for text in texts:
        value = json.loads(text)
        assert isinstance(value, list) and len(value) <= 4 and set(value) <= {"a", "bb", "ccc"}


# Logprobs: of the masked distribution.
def test_logprobs_are_of_the_allowed_tokens_only(tiny):
    grammar = tiny.grammars.json_schema({"enum": ["bird", "fish"]})
    choice = _choice(tiny, SamplingParams(temperature=0, max_tokens=30, logprobs=20, grammar=grammar))
    assert json.loads(choice.text) in ("bird", "fish")
    for token_id, entry in zip(choice.token_ids, choice.logprobs):
        assert entry.token_id == token_id == entry.top[0][0]  # greedy over the allowed tokens
        # Fewer than 20 tokens can begin or go on with "bird" or "fish": the 20 alternatives hold them all, their
        # probabilities add up to 1, and the rest are masked (-inf).
        finite = [lp for _, lp in entry.top if lp != float("-inf")]
        assert len(finite) < 20 and sum(torch.tensor(finite).exp()) == pytest.approx(1.0, abs=1e-4)


def test_unconstrained_logprobs_are_unchanged_by_a_constrained_neighbour(tiny):
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    alone = _choice(tiny, params).logprobs
    constrained = SamplingParams(temperature=0, max_tokens=8, grammar=tiny.grammars.json_object())
    streams = [tiny.submit(PROMPT, constrained), tiny.submit(PROMPT, params)]
    beside = [lp for out in streams[1] for lp in out.logprobs]
    list(streams[0])
    # Tokens exactly; logprobs to float32 rounding (aten's matmul, TERN_CPU_KERNELS=off, differs in the last bits
    # between a batch of one and of two).
    assert [(e.token_id, [t for t, _ in e.top]) for e in beside] == [(e.token_id, [t for t, _ in e.top]) for e in alone]
    for b, a in zip(beside, alone):
        assert b.logprob == pytest.approx(a.logprob, abs=1e-5)
        assert [lp for _, lp in b.top] == pytest.approx([lp for _, lp in a.top], abs=1e-5)


# Compiling.
@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        ({"type": "strin"}, "strin"),
        ({"type": "string", "pattern": "(("}, "regex"),
        ({"$ref": "#/$defs/missing"}, "missing"),
        ({"type": "object", "properties": 5}, "properties"),
        ({"type": "object", "required": ["a"], "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}},
         "unsatisfiable"),
        ({"not": {"type": "string"}}, "not"),
    ],
)
def test_schemas_that_cannot_be_compiled_raise_naming_the_problem(tiny, schema, problem):
    with pytest.raises(GrammarError) as caught:
        tiny.grammars.json_schema(schema)
    assert problem in caught.value.message.lower() or problem in caught.value.message


def test_grammars_are_cached_by_schema_least_recently_used_out_first(default_tokenizer):
    compiler = GrammarCompiler(default_tokenizer, len(default_tokenizer), frozenset({2}), max_cached=2)
    a = compiler.json_schema({"type": "integer"})
    assert compiler.json_schema({"type": "integer"}) is a
    b = compiler.json_schema({"type": "boolean"})
    compiler.json_schema({"type": "integer"})  # a is now the most recent
    compiler.json_schema({"type": "null"})  # evicts b
    assert compiler.num_cached == 2
    assert compiler.json_schema({"type": "integer"}) is a and compiler.json_schema({"type": "boolean"}) is not b
    # Key order matters: properties are written in the order the schema lists them.
    xy = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}
    yx = {**xy, "properties": dict(reversed(xy["properties"].items()))}
    assert compiler.json_schema(xy) is not compiler.json_schema(yx)


def test_mask_logits_leaves_rows_without_a_grammar_alone(default_tokenizer):
    compiler = GrammarCompiler(default_tokenizer, len(default_tokenizer), frozenset({2}))
    logits = torch.randn(3, len(default_tokenizer))
    assert mask_logits(logits, [None, None, None]) is logits
    matcher = compiler.json_schema({"enum": ["yes", "no"]}).matcher()
    masked = mask_logits(logits, [None, matcher, None])
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    allowed = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    assert allowed and all(default_tokenizer.decode([t]).startswith('"') for t in allowed)
    assert torch.equal(masked[1, allowed], logits[1, allowed])


# The default model.
@pytest.mark.slow
def test_the_default_model_answers_in_the_schema_greedy_and_sampled(default_engine):
    grammar = default_engine.grammars.json_schema(FEATURES, "animal")
    messages = [{"role": "user", "content": "Describe a seabird as JSON with an id, kind, name, tags and origin."}]
    prompt = _chat_prompt(default_engine, messages)
    for params in (SamplingParams(temperature=0, max_tokens=300, grammar=grammar),
                   SamplingParams(temperature=1.0, max_tokens=300, n=3, seed=0, grammar=grammar)):
        for choice in default_engine.generate([prompt], params)[0].choices:
            assert choice.finish_reason == "stop", choice.text
            jsonschema.validate(json.loads(choice.text), FEATURES)


@pytest.mark.slow
def test_the_default_model_under_json_object_writes_one_object(default_engine):
    messages = [{"role": "user", "content": "Give the name and the wingspan of a common tern, in JSON."}]
    prompt = _chat_prompt(default_engine, messages)
    params = SamplingParams(temperature=0, max_tokens=200, grammar=default_engine.grammars.json_object())
    choice = _choice(default_engine, params, prompt)
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.text), dict), choice.text
