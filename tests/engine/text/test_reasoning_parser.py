"""The reasoning parser as a pure function: a thinking model's text split into reasoning and answer, whole or fed in
pieces cut anywhere (a tag may arrive across two deltas), and which models count as thinking ones."""
from __future__ import annotations

import pytest

from engine.text.reasoning import ReasoningTags, count_reasoning_tokens, detect_reasoning, split_reasoning

TAGS = ReasoningTags(has_switch=True)
QWEN3_REPLY = "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"


def fed_in_pieces(text: str, cuts: list[int], start: str = "either") -> tuple[str, str, bool]:
    """(reasoning, answer, has_reasoning) from the text fed as deltas cut at `cuts`, joined as a client would."""
    parser = TAGS.parser(start)
    bounds = [0, *cuts, len(text)]
    reasoning = answer = ""
    for begin, end in zip(bounds, bounds[1:]):
        r, a = parser.feed(text[begin:end])
        reasoning, answer = reasoning + r, answer + a
    r, a = parser.finish()
    return reasoning + r, answer + a, parser.has_reasoning


def test_a_qwen3_reply_splits_into_reasoning_and_an_answer_without_leading_whitespace():
    assert split_reasoning(QWEN3_REPLY, TAGS) == ("\nThe user greets me.\n", "Hello! How can I help?")


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7])
def test_deltas_cut_anywhere_give_the_whole_text_split(size):
    cuts = list(range(size, len(QWEN3_REPLY), size))
    assert fed_in_pieces(QWEN3_REPLY, cuts) == ("\nThe user greets me.\n", "Hello! How can I help?", True)


def test_a_tag_cut_across_deltas_never_leaks_a_piece_of_itself():
    parser = TAGS.parser("either")
    assert parser.feed("<thi") == ("", "")  # held: may become <think>
    assert parser.feed("nk>plan</th") == ("plan", "")  # "</th" held: may become </think>
    assert parser.feed("ink> answer") == ("", "answer")


def test_a_reply_that_never_closes_its_reasoning_is_all_reasoning():
    assert split_reasoning("<think>step one, step two", TAGS) == ("step one, step two", "")
    assert fed_in_pieces("<think>step one </th", [3, 9]) == ("step one </th", "", True)  # a cut tag is text


def test_without_a_think_block_everything_is_the_answer():
    assert split_reasoning("Just an answer.", TAGS) == (None, "Just an answer.")
    assert fed_in_pieces("<b>bold</b> answer", [1, 2]) == ("", "<b>bold</b> answer", False)


def test_a_think_tag_after_the_answer_began_is_part_of_the_answer():
    assert split_reasoning("Answer first <think>x</think>", TAGS) == (None, "Answer first <think>x</think>")


def test_a_prompt_that_opened_the_block_makes_the_reply_start_inside_reasoning():
    start = TAGS.reply_start("<|im_start|>assistant\n<think>\n")
    assert start == "reasoning"
    assert split_reasoning("thinking...</think>\n\nThe answer", TAGS, start) == ("thinking...", "The answer")


def test_a_prompt_that_closed_an_empty_block_leaves_only_an_answer():
    start = TAGS.reply_start("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert start == "answer"
    assert split_reasoning("<think>not reasoning", TAGS, start) == (None, "<think>not reasoning")


def test_earlier_turns_reasoning_in_the_prompt_does_not_decide_the_new_reply():
    history = "<|im_start|>assistant\n<think>\nold\n</think>\n\nold answer<|im_end|>\n<|im_start|>assistant\n"
    assert TAGS.reply_start(history) == "either"


def test_a_model_thinks_when_its_vocabulary_and_its_template_both_have_the_tags():
    vocab = {"<think>": 1, "</think>": 2}
    qwen3_like = "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    assert detect_reasoning(vocab, qwen3_like) == ReasoningTags(has_switch=True, close_id=2)
    assert detect_reasoning(vocab, "{{ '<think>\n' }}{# </think> #}") == ReasoningTags(has_switch=False, close_id=2)
    assert detect_reasoning(vocab, "{{ messages }}") is None  # reserved tokens, a template that never uses them
    assert detect_reasoning({}, qwen3_like) is None
    assert detect_reasoning(vocab, None) is None


def test_reasoning_tokens_count_through_the_closing_tag_or_all_of_an_unclosed_reply():
    tags = ReasoningTags(close_id=99)
    assert count_reasoning_tokens([7, 8, 8, 99, 5, 6], tags, has_reasoning=True) == 4  # <think> . . </think>
    assert count_reasoning_tokens([7, 8, 8, 8], tags, has_reasoning=True) == 4  # cut before it closed
    assert count_reasoning_tokens([5, 99, 6], tags, has_reasoning=False) == 0  # an answer only: a stray tag is text
    assert detect_reasoning({"<think>": 3, "</think>": 4}, "{{ '<think>' }}{{ '</think>' }}").close_id == 4
