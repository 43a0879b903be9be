"""Incremental detokenizer + stop-string matcher: generated token ids in, text deltas that are safe to send out."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

# How many prompt tokens to decode in front of the first generated token. Decoders decide a token's leading space
# from its neighbours (SentencePiece strips it from the first token of a decode call), so a little context gives the
# first token the space it has in the full text. vLLM uses the same number (INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
_NUM_CONTEXT_IDS = 5

# What tokenizers decode an incomplete UTF-8 byte sequence to.
_REPLACEMENT_CHAR = "\ufffd"


class OutputText:
    """Incremental detokenizer + stop-string matcher for one generated sequence."""

    def __init__(
        self,
        tokenizer: Any,  # engine.text.tokens.TokenizerView: decode(ids, skip_special_tokens) and token_bytes(token_id)
        stop: list[str] | tuple[str, ...] = (),
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # An empty stop string would match before the first character and end every request with no text.
        self._stops = tuple(s for s in stop if s)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)

        context_ids = list(prompt_ids[-_NUM_CONTEXT_IDS:]) if prompt_ids else []
        # A prompt that ends inside a character would make the first delta start mid-character; decoding the
        # output on its own is then the better answer.
        if context_ids and self._decode(context_ids).endswith(_REPLACEMENT_CHAR):
            context_ids = []
        # Decode window, as in vLLM/TGI: ids[prefix_offset:read_offset] is text already turned into characters,
        # kept only as left context; ids[read_offset:] has not produced complete characters yet.
        self._ids = context_ids
        self._prefix_offset = 0
        self._read_offset = len(context_ids)
        self._prefix_text = self._decode(context_ids)

        self._held = ""  # decoded characters not sent yet, because they may begin a stop string
        self._text = ""
        self._stop_reason: str | None = None

    def append(self, token_id: int) -> tuple[str, bool]:
        """Add one generated token. Returns (text_delta, stopped). text_delta is the text that is now safe to
        send: complete characters only (a character split across tokens, e.g. emoji/CJK, is held back until
        complete), and text that could still turn out to be the beginning of a stop string is held back too.
        When a stop string is found (possibly spanning several tokens), stopped=True, the output text is cut
        right before the stop string (the stop string and anything after it never appear) and text_delta is
        whatever of the text before the stop string had not been emitted yet."""
        if self._stop_reason is not None:
            return "", True
        self._ids.append(token_id)
        new_text = self._decode(self._ids[self._prefix_offset :])
        # Only the window is decoded, so the cost per token does not grow with the output. A trailing U+FFFD
        # means the last token ended inside a multi-byte character: wait for the bytes that complete it. Text
        # no longer than the context (a skipped special token) adds nothing and leaves the window as it is.
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return "", False
        self._held += new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return self._release()

    def finish(self) -> str:
        """The sequence ended for another reason (EOS, length, abort): release all held-back text (a partial
        stop-string prefix). A character the last tokens began but never completed is left out: its bytes can no
        longer become text, and a U+FFFD in their place would be a character the model never wrote. Returns the
        final delta."""
        if self._stop_reason is not None:
            return ""
        new_text = self._decode(self._ids[self._prefix_offset :])
        if new_text.endswith(_REPLACEMENT_CHAR):
            new_text = self._decode_complete(self._ids[self._prefix_offset :])
        delta = self._held + new_text[len(self._prefix_text) :]
        self._held = ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prefix_text = ""
        self._text += delta
        return delta

    @property
    def text(self) -> str:
        """All text emitted so far: the concatenation of every delta returned."""
        return self._text

    @property
    def stop_reason(self) -> str | None:
        """The stop string that matched, or None."""
        return self._stop_reason

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_complete(self, ids: list[int]) -> str:
        """decode(ids) without the bytes at its end that begin a character and do not finish it.

        Decoders show those bytes as U+FFFD, but so they show invalid bytes and the character U+FFFD itself, which
        are text: only the tokens' bytes tell them apart. The ids before read_offset decoded to whole characters, so
        an unfinished one begins after them."""
        num_done = self._read_offset - self._prefix_offset
        # A skipped special token adds no text, so no bytes either.
        pieces = [self._tokenizer.token_bytes(i) if self._decode([i]) else b"" for i in ids[num_done:]]
        num_unfinished = _num_unfinished_bytes(b"".join(pieces))
        if num_unfinished == 0:
            return self._decode(ids)
        end = len(ids)  # walk back to the token in which the unfinished character begins
        while num_unfinished > 0:
            end -= 1
            num_unfinished -= len(pieces[end - num_done])
        # That token may begin with whole characters (byte-level BPE has " \xf0\x9f"): they stay. Only a byte-level
        # token can hold both, and its text is its bytes decoded, so decoding them here gives what the tokenizer would.
        num_whole = -num_unfinished  # the walk went this many bytes past the character's beginning
        whole = pieces[end - num_done][:num_whole]
        return self._decode(ids[:end]) + whole.decode("utf-8", errors="replace")

    def _release(self) -> tuple[str, bool]:
        """Cut at the earliest stop string in the held text, or send what can no longer begin one."""
        # Everything sent so far could not begin a stop string, so a match can only start inside the held text,
        # which is at most one stop string long plus the newest token's text: the search stays short.
        match_start, match = len(self._held), None
        for stop in self._stops:  # earliest start wins; on a tie, the stop string listed first
            start = self._held.find(stop)
            if start != -1 and start < match_start:
                match_start, match = start, stop
        if match is not None:
            self._stop_reason = match
            delta = self._held[:match_start]
            self._held = ""
        else:
            num_held = _longest_stop_prefix(self._held, self._stops, self._max_stop_len)
            delta = self._held[: len(self._held) - num_held]
            self._held = self._held[len(self._held) - num_held :]
        self._text += delta
        return delta, match is not None


def _num_unfinished_bytes(data: bytes) -> int:
    """How many bytes at the end of data begin a UTF-8 character without finishing it (0 to 3)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(data)  # not final: the decoder keeps an unfinished character's bytes back, waiting for the rest
    return len(decoder.getstate()[0])


def _longest_stop_prefix(text: str, stops: tuple[str, ...], max_stop_len: int) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string (0 if none)."""
    # A suffix as long as a whole stop string would already have matched, hence max_stop_len - 1.
    for length in range(min(len(text), max_stop_len - 1), 0, -1):
        suffix = text[-length:]
        if any(stop.startswith(suffix) for stop in stops):
            return length
    return 0
