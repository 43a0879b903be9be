"""Reasoning in a thinking model's output: whether a model thinks (decided once, from its tokenizer), where a reply
starts (inside `<think>` or not, read off the rendered prompt), and the split of its text into reasoning and answer.

Thinking models (Qwen3, DeepSeek-R1 and its distills) write their reasoning between `<think>` and `</think>`, then the
answer. vLLM, llama-server, SGLang and Ollama hand the reasoning back in a field of its own; so does Tern, through
this one parser, which chat, the Responses API and the UI share (and the Anthropic API's `thinking` blocks may).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"
# The chat-template variable that turns thinking off (Qwen3; vLLM and llama-server pass it as chat_template_kwargs).
THINKING_SWITCH = "enable_thinking"


@dataclass(frozen=True)
class ReasoningTags:
    """How a thinking model marks its reasoning; `has_switch`: its template reads `enable_thinking`."""

    open_tag: str = OPEN_TAG
    close_tag: str = CLOSE_TAG
    has_switch: bool = False
    close_id: int | None = None  # the closing tag's token id (a token of its own: detect_reasoning asks)

    def reply_start(self, prompt_text: str) -> str:
        """Where the reply to this rendered prompt starts: "reasoning" when the prompt leaves a `<think>` open (a
        DeepSeek-R1 template opens it for the model), "answer" when the prompt already closed the block (Qwen3's
        template with enable_thinking false writes an empty one), else "either" (the model may open one itself)."""
        opened, closed = prompt_text.rfind(self.open_tag), prompt_text.rfind(self.close_tag)
        if opened > closed:
            return "reasoning"
        if closed >= 0 and prompt_text.rstrip().endswith(self.close_tag):
            return "answer"
        return "either"

    def parser(self, start: str) -> ReasoningParser:
        return ReasoningParser(self, start)

    def describe(self) -> str:
        switch = f"; turned off per request with chat_template_kwargs {{\"{THINKING_SWITCH}\": false}}" \
            if self.has_switch else ""
        return f"reasoning between {self.open_tag} and {self.close_tag} goes to reasoning_content{switch}"


def detect_reasoning(vocab: Mapping[str, int], chat_template: str | None) -> ReasoningTags | None:
    """Whether the model thinks: its vocabulary has `<think>` and `</think>` as tokens of their own AND its chat
    template mentions them (a vocabulary alone is not enough: many tokenizers reserve the tokens and never use them)."""
    if not chat_template or OPEN_TAG not in vocab or CLOSE_TAG not in vocab:
        return None
    if OPEN_TAG not in chat_template or CLOSE_TAG not in chat_template:
        return None
    return ReasoningTags(has_switch=THINKING_SWITCH in chat_template, close_id=vocab[CLOSE_TAG])


@dataclass
class ReasoningParser:
    """One reply's text, fed as it is decoded, split into (reasoning_delta, answer_delta) pairs.

    A tag may arrive cut across deltas ("</th" then "ink>"): text that could still become a tag is held back until
    the next delta (or finish()) decides it. Rules, as vLLM's Qwen3/DeepSeek-R1 parsers: the reply is reasoning
    from its start when the prompt left `<think>` open, or when the reply itself begins (after whitespace) with
    `<think>`; reasoning ends at the first `</think>`; everything after is the answer, its leading whitespace
    dropped. A reply that never closes its reasoning (cut by max_tokens) is reasoning only."""

    tags: ReasoningTags
    start: str = "either"  # ReasoningTags.reply_start()
    _state: str = field(init=False)  # "start": may still open a block; "reasoning"; "answer"
    _held: str = field(default="", init=False)
    _trims_answer: bool = field(default=False, init=False)  # just after </think>: drop the answer's leading space
    reasoning: str = field(default="", init=False)
    answer: str = field(default="", init=False)
    has_reasoning: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self._state = {"reasoning": "reasoning", "answer": "answer"}.get(self.start, "start")
        self.has_reasoning = self._state == "reasoning"

    def feed(self, text: str) -> tuple[str, str]:
        return self._consume(self._held + text, final=False)

    def finish(self) -> tuple[str, str]:
        """The reply ended: what was held back is what it looked like (a cut-off tag is text)."""
        return self._consume(self._held, final=True)

    def _consume(self, text: str, final: bool) -> tuple[str, str]:
        self._held = ""
        reasoning, answer = "", ""
        if self._state == "start":
            stripped = text.lstrip()
            if stripped.startswith(self.tags.open_tag):
                self._state, self.has_reasoning = "reasoning", True
                text = stripped[len(self.tags.open_tag):]
            elif not final and self.tags.open_tag.startswith(stripped):
                self._held = text  # whitespace or a piece of "<think>": not decided yet
                return "", ""
            else:
                self._state = "answer"
        if self._state == "reasoning":
            end = text.find(self.tags.close_tag)
            if end < 0:
                keep = 0 if final else _partial_suffix(text, self.tags.close_tag)
                reasoning, self._held = text[:len(text) - keep], text[len(text) - keep:]
                text = ""
            else:
                reasoning, text = text[:end], text[end + len(self.tags.close_tag):]
                self._state, self._trims_answer = "answer", True
        if self._state == "answer" and text:
            if self._trims_answer:
                text = text.lstrip()
                self._trims_answer = not text
            answer = text
        self.reasoning += reasoning
        self.answer += answer
        return reasoning, answer


def count_reasoning_tokens(token_ids: Sequence[int], tags: ReasoningTags, has_reasoning: bool) -> int:
    """How many of a reply's tokens are its reasoning, its tags included (OpenAI's
    usage.completion_tokens_details.reasoning_tokens): through the closing tag, or all of them when the reply ended
    before closing it; 0 for a reply that did not think (has_reasoning: what its parser found)."""
    if not has_reasoning:
        return 0
    if tags.close_id is not None and tags.close_id in token_ids:
        return list(token_ids).index(tags.close_id) + 1
    return len(token_ids)


def split_reasoning(text: str, tags: ReasoningTags, start: str = "either") -> tuple[str | None, str]:
    """A whole reply -> (reasoning, or None when it has none; answer): the same rules as the stream, by the same
    parser, so a streamed reply and a whole one always agree."""
    parser = tags.parser(start)
    parser.feed(text)
    parser.finish()
    return (parser.reasoning if parser.has_reasoning else None), parser.answer


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a beginning of `tag` (it may be the tag arriving in pieces)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def thinking_kwargs(tags: ReasoningTags | None, is_constrained: bool) -> dict:
    """Template variables a reply needs: one a grammar holds from its first token (a JSON schema, a required tool
    call) has no room for reasoning, so thinking is turned off where the template has the switch."""
    return {THINKING_SWITCH: False} if is_constrained and tags is not None and tags.has_switch else {}


def reply_start_for(tags: ReasoningTags | None, prompt_text: str, is_constrained: bool) -> str | None:
    """Where the reply to this prompt starts (ReasoningTags.reply_start), or None when it is not split at all: the
    model does not think, a grammar holds the reply (all of it is the answer), or the prompt closed the block."""
    if tags is None or is_constrained:
        return None
    start = tags.reply_start(prompt_text)
    return None if start == "answer" else start
