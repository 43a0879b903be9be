"""Reading a reply back into text and tool calls as it streams, in the format engine/text/tool_calls.py defines (a
call's JSON between tags), as early as each piece is certain.

A call is certain once its arguments' JSON value is complete (and parses): only then does it go out, name and
arguments in one CallDelta. A call that max_tokens cuts before that point is text, so a stream never announces a
call that then breaks off, and no client ever gets arguments that are not JSON."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from engine.text.tool_calls import CLOSE_TAG, OPEN_TAG


@dataclass
class CallDelta:
    """News of one call: its name and its whole arguments' JSON text (the parser sends each call once, complete)."""

    index: int
    name: str
    arguments: str


@dataclass
class ParsedCall:
    name: str
    arguments: str  # the arguments' JSON text exactly as the model wrote it


# A call's head up to its arguments; the grammar writes `name` first.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


class ReplyParser:
    """Splits a reply, fed in text deltas, into its text and its calls, as early as each is certain.

    Text that could still be the start of an opening tag is held back, and so is whitespace, until text that is
    neither follows: whitespace around calls is layout, not content. A call is held back until its arguments' JSON
    value is complete; then its CallDelta goes out. Feeding the whole reply at once gives the same text and calls
    as feeding it in any pieces.
    """

    def __init__(self) -> None:
        self.calls: list[ParsedCall] = []
        self.text = ""  # all content released so far
        self._pending = ""  # text held back: outside a call, or the part of a call not read yet
        self._in_call = False
        self._scanner: _ValueScanner | None = None  # set once a call's head is read: where its arguments end
        self._call_text = ""  # the current call's text read so far (after its opening tag): text again if it is cut
        self._call_name = ""
        self._call_arguments = ""
        self._call_is_text = False  # its arguments ended but are no JSON (no grammar held them): text once closed
        self._after_call = False  # whitespace right after a closing tag is layout
        self._content = ""
        self._deltas: list[CallDelta] = []

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """Add text; returns (content delta, call deltas) that are now certain."""
        self._pending += text
        while self._read_call() if self._in_call else self._read_text():
            pass
        return self._release()

    def finish(self) -> tuple[str, list[CallDelta]]:
        """The reply ended: release what was held. Trailing whitespace is content only in a reply without calls.
        A call cut short (max_tokens) before its arguments were complete is text; one cut after them (before its
        closing tag) was already sent."""
        if self._in_call:
            if self._scanner is None or not self._scanner.done or self._call_is_text:
                self._content += OPEN_TAG + self._call_text + self._pending
        else:
            self._content += self._pending.rstrip() if self.calls else self._pending
        self._pending = ""
        return self._release()

    def _release(self) -> tuple[str, list[CallDelta]]:
        content, deltas = self._content, self._deltas
        self._content, self._deltas = "", []
        self.text += content
        return content, deltas

    def _read_text(self) -> bool:
        if self._after_call:
            self._pending = self._pending.lstrip()
            self._after_call = not self._pending
        start = self._pending.find(OPEN_TAG)
        if start != -1:
            self._content += self._pending[:start].rstrip()
            self._pending = self._pending[start + len(OPEN_TAG):]
            self._in_call, self._scanner = True, None
            return True
        # Hold back a tail that may begin the tag, and whitespace that may turn out to precede one.
        body = self._pending[: len(self._pending) - _tag_prefix_length(self._pending)]
        cut = len(body.rstrip())
        self._content += self._pending[:cut]
        self._pending = self._pending[cut:]
        return False

    def _read_call(self) -> bool:
        if self._scanner is None:
            match = _HEAD.match(self._pending)
            if match is None:
                return self._read_whole_call()
            self._call_name = json.loads(match.group(1))
            self._take(match.end())
            self._scanner = _ValueScanner()
        if not self._scanner.done:
            if not self._scanner.started:  # whitespace before the value is not part of the arguments' text
                self._take(len(self._pending) - len(self._pending.lstrip()))
            taken = self._scanner.feed(self._pending)
            self._call_arguments += self._pending[:taken]
            self._take(taken)
            if not self._scanner.done:
                return False
            self._send_call()
        end = self._pending.find(CLOSE_TAG)
        if end == -1:
            return False
        if self._call_is_text:
            self._content += OPEN_TAG + self._call_text + self._pending[:end] + CLOSE_TAG
        self._end_call(end)
        return True

    def _take(self, length: int) -> None:
        """Move the first `length` characters of pending text into the current call's text."""
        self._call_text += self._pending[:length]
        self._pending = self._pending[length:]

    def _send_call(self) -> None:
        try:
            json.loads(self._call_arguments)
        except json.JSONDecodeError:  # only without a grammar: the text stays text
            self._call_is_text = True
            return
        self.calls.append(ParsedCall(self._call_name, self._call_arguments))
        self._deltas.append(CallDelta(len(self.calls) - 1, self._call_name, self._call_arguments))

    def _read_whole_call(self) -> bool:
        """A body whose name does not come first (a grammar never lets that happen): once the closing tag is
        there, take it whole if it is a call, else give it back as text."""
        end = self._pending.find(CLOSE_TAG)
        if end == -1:
            return False
        body = self._pending[:end]
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict) and isinstance(value.get("name"), str) and "arguments" in value:
            index = len(self.calls)
            self.calls.append(ParsedCall(value["name"], json.dumps(value["arguments"], ensure_ascii=False)))
            self._deltas.append(CallDelta(index, value["name"], self.calls[-1].arguments))
        else:
            self._content += OPEN_TAG + body + CLOSE_TAG
        self._end_call(end)
        return True

    def _end_call(self, close_at: int) -> None:
        self._pending = self._pending[close_at + len(CLOSE_TAG):]
        self._in_call, self._scanner, self._after_call = False, None, True
        self._call_text, self._call_name, self._call_arguments, self._call_is_text = "", "", "", False


def _tag_prefix_length(text: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of the opening tag."""
    for length in range(min(len(text), len(OPEN_TAG) - 1), 0, -1):
        if OPEN_TAG.startswith(text[-length:]):
            return length
    return 0


class _ValueScanner:
    """Finds where one JSON value ends in text that arrives in pieces, without parsing it: brackets are counted
    outside strings, and a bare scalar ends at the first delimiter."""

    def __init__(self) -> None:
        self.done = False
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self.started = False

    def feed(self, text: str) -> int:
        """How many characters of text belong to the value (all of them unless it ends inside text)."""
        for i, char in enumerate(text):
            self.started = True
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
                    if self._depth == 0:
                        self.done = True
                        return i + 1
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                if self._depth == 0:  # a bare scalar ended at its container's closing bracket
                    self.done = True
                    return i
                self._depth -= 1
                if self._depth == 0:
                    self.done = True
                    return i + 1
            elif self._depth == 0 and (char == "," or char.isspace()):
                self.done = True
                return i
        return len(text)
