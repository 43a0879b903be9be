"""Which FIM tokens a vocabulary has: StarCoder's family, Qwen2.5-Coder's, or none (the default model's)."""
from __future__ import annotations

from engine.text.fill_in_middle import FimTokens, find_fim_tokens
from engine.text.tokens import TokenizerView


def test_either_family_is_found_and_a_partial_one_is_not():
    qwen = {"<|fim_prefix|>": 151659, "<|fim_middle|>": 151660, "<|fim_suffix|>": 151661, "a": 0}
    assert find_fim_tokens(qwen) == FimTokens(prefix_id=151659, suffix_id=151661, middle_id=151660)
    starcoder = {"<fim_prefix>": 1, "<fim_middle>": 2, "<fim_suffix>": 3, "<fim_pad>": 4}
    assert find_fim_tokens(starcoder) == FimTokens(1, 3, 2)
    assert find_fim_tokens({"<fim_prefix>": 1, "<fim_suffix>": 3}) is None


def test_the_prompt_is_prefix_suffix_middle():
    assert FimTokens(1, 3, 2).prompt_ids([10, 11], [20]) == [1, 10, 11, 3, 20, 2]


def test_the_default_tokenizer_has_no_fim_tokens(default_tokenizer):
    assert TokenizerView(default_tokenizer).fim_tokens is None
