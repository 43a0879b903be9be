"""Logprob shaping on its own: chat's content[] entries, legacy completion lists, and text offsets."""
from __future__ import annotations

import json

import pytest

from api.logprobs import MIN_LOGPROB, chat_logprobs, completion_logprobs, merge_logprobs, text_offsets, visible_logprobs
from engine import TokenLogprob
from engine.text.tokens import TokenizerView


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer):
    return TokenizerView(default_tokenizer)


def test_chat_entries_carry_text_exact_bytes_and_alternatives(tokenizer):
    ids = tokenizer.encode(" Paris", add_special_tokens=False) + tokenizer.encode(" ok", add_special_tokens=False)
    entries = [TokenLogprob(ids[0], -0.5, [(ids[0], -0.5), (ids[1], -2.0)]), TokenLogprob(ids[1], -1.0, [])]
    content = chat_logprobs(entries, tokenizer)
    assert "".join(c["token"] for c in content) == " Paris ok"
    assert bytes(content[0]["bytes"]) == b" Paris"
    assert [t["token"] for t in content[0]["top_logprobs"]] == [" Paris", " ok"]
    assert content[1]["top_logprobs"] == []
    json.dumps(content, allow_nan=False)


def test_a_token_that_is_half_a_character_has_its_raw_bytes(tokenizer):
    ids = tokenizer.encode("🐦", add_special_tokens=False)
    assert len(ids) > 1  # the emoji spans several byte-level tokens
    content = chat_logprobs([TokenLogprob(t, -1.0) for t in ids], tokenizer)
    assert b"".join(bytes(c["bytes"]) for c in content).decode("utf-8") == "🐦"


def test_minus_infinity_and_nan_become_openais_floor(tokenizer):
    content = chat_logprobs([TokenLogprob(5, float("-inf"), [(5, float("nan"))])], tokenizer)
    assert content[0]["logprob"] == MIN_LOGPROB and content[0]["top_logprobs"][0]["logprob"] == MIN_LOGPROB


def test_chat_hides_the_end_of_sequence_token_but_not_a_stop_string():
    entries = [TokenLogprob(1, -0.1), TokenLogprob(2, -0.2)]
    assert visible_logprobs(entries, "stop", None) == entries[:1]  # EOS
    assert visible_logprobs(entries, "stop", 2) == entries[:1]  # a stop token id
    assert visible_logprobs(entries, "stop", "\n") == entries  # the text held the stop string
    assert visible_logprobs(entries, "length", None) == entries


def test_completion_lists_follow_the_legacy_shape(tokenizer):
    ids = tokenizer.encode("The capital of France", add_special_tokens=False)
    entries = [None] + [TokenLogprob(t, -1.0 - i, [(t, -1.0 - i)] if i % 2 else [(7, -0.5)]) for i, t in enumerate(ids[1:])]
    result = completion_logprobs(ids, entries, [0, 3, 11, 14], tokenizer)
    assert result["tokens"] == ["The", " capital", " of", " France"]
    assert result["token_logprobs"][0] is None and result["top_logprobs"][0] is None
    assert result["text_offset"] == [0, 3, 11, 14]
    for i in range(1, len(ids)):  # the token itself is always among its alternatives
        assert result["top_logprobs"][i][result["tokens"][i]] == result["token_logprobs"][i]
    # lm-evaluation-harness's greedy test: the token's logprob is the best of its dict exactly when it was top-1.
    greedy = [lp == max(top.values()) for lp, top in zip(result["token_logprobs"][1:], result["top_logprobs"][1:])]
    assert greedy == [False, True, False]


def test_two_alternatives_that_decode_alike_keep_the_better_logprob(tokenizer):
    # Byte tokens of one emoji all decode to U+FFFD on their own.
    a, b = tokenizer.encode("🐦", add_special_tokens=False)[:2]
    result = completion_logprobs([a], [TokenLogprob(a, -3.0, [(b, -1.0), (a, -3.0)])], [0], tokenizer)
    assert result["top_logprobs"][0] == {"\ufffd": -1.0}


def test_merge_puts_the_prompt_first():
    first = {"tokens": ["a"], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
    second = {"tokens": ["b"], "token_logprobs": [-1.0], "top_logprobs": [{"b": -1.0}], "text_offset": [1]}
    assert merge_logprobs(first, second)["tokens"] == ["a", "b"]
    assert merge_logprobs(first, second)["text_offset"] == [0, 1]


@pytest.mark.parametrize("text", ["Hello world, how are you?", "héllo 你好 🐦 done", "  two  spaces\n\nand lines"])
def test_offsets_point_into_the_decoded_text(default_tokenizer, tokenizer, text):
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    offsets = text_offsets(tokenizer, ids, skip_special_tokens=False)
    decoded = default_tokenizer.decode(ids)
    assert decoded == text
    assert offsets[0] == 0 and offsets == sorted(offsets)
    for i, offset in enumerate(offsets):
        # Every token's text starts at its offset, unless it is part of a character split over tokens.
        piece = default_tokenizer.decode([ids[i]])
        if "\ufffd" not in piece:
            assert decoded[offset : offset + len(piece)] == piece


def test_offsets_can_start_further_on_and_skip_special_tokens(tokenizer):
    ids = [1] + tokenizer.encode("Hi there", add_special_tokens=False)  # 1 = <|im_start|>
    assert text_offsets(tokenizer, ids, skip_special_tokens=True, start=10) == [10, 10, 12]
    assert text_offsets(tokenizer, ids, skip_special_tokens=False) == [0, len("<|im_start|>"), len("<|im_start|>Hi")]
