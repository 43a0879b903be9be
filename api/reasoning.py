"""Reasoning on the API: `chat_template_kwargs` checked, thinking turned off for replies a grammar holds, and whether
(and from where) a request's reply is split into reasoning and answer by engine/text/reasoning.py.

The rule for constrained replies (response_format json, or tool_choice "required" / a named function): a grammar
forces the answer from the first token, so there is no room for reasoning. Such a request renders the template with
`enable_thinking: false` when the template has that switch, and its reply is never split: all of it is the answer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine import Engine
from engine.text.reasoning import (
    ReasoningParser, ReasoningTags, count_reasoning_tokens, reply_start_for, split_reasoning, thinking_kwargs,
)

from api import function_tools
from api.errors import OpenAIError
from api.response_format import AnswerFormat

@dataclass(frozen=True)
class ReplyReasoning:
    """How one request's reply is split: the model's tags, and where the reply starts (ReasoningTags.reply_start)."""

    tags: ReasoningTags
    start: str

    def parser(self) -> ReasoningParser:
        return self.tags.parser(self.start)


def checked_template_kwargs(engine: Engine, kwargs: Any, param: str = "chat_template_kwargs") -> dict:
    """The client's template variables: an object whose names do not clash with what the server passes."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise OpenAIError(400, f"{param} must be an object of template variables", param=param, code="invalid_value")
    for name in kwargs:
        if name in engine.tokenizer.reserved_template_names:
            message = f"{param} may not set {name!r}: the server sets it (send it as the request field, if any)"
            raise OpenAIError(400, message, param=f"{param}.{name}", code="invalid_value")
    return dict(kwargs)


def is_constrained(answer: AnswerFormat, tools: function_tools.Tools) -> bool:
    """Whether a grammar holds the reply from its first token (tools under "auto" leave it free until a call)."""
    return answer.schema is not None or (tools.use is not None and tools.use.mode != "auto")


def render_kwargs(engine: Engine, kwargs: dict, constrained: bool) -> dict:
    """The variables the template renders with: a constrained reply turns thinking off where the template can."""
    return {**kwargs, **thinking_kwargs(engine.tokenizer.reasoning, constrained)}


def reply_reasoning(engine: Engine, prompt_text: str, constrained: bool) -> ReplyReasoning | None:
    """How to split the reply to this prompt, or None: the model does not think, the template turned thinking off
    (its prompt closed the block), or a grammar holds the reply."""
    start = reply_start_for(engine.tokenizer.reasoning, prompt_text, constrained)
    return None if start is None else ReplyReasoning(engine.tokenizer.reasoning, start)


def split_reply(split: ReplyReasoning, text: str) -> tuple[str | None, str]:
    """A whole reply -> (reasoning or None, answer)."""
    return split_reasoning(text, split.tags, split.start)


def feed_reply(parser: ReasoningParser | None, text: str, is_last: bool) -> tuple[str, str]:
    """One engine output of a streamed reply -> (reasoning delta, answer delta); without a parser all is answer."""
    if parser is None:
        return "", text
    thought, answer = parser.feed(text)
    if is_last:
        more_thought, more_answer = parser.finish()
        thought, answer = thought + more_thought, answer + more_answer
    return thought, answer


def reasoning_tokens(split: ReplyReasoning | None, token_ids: list[int], has_reasoning: bool) -> int:
    """One reply's reasoning tokens for `usage`: 0 where the reply is not split (the model does not think, or a
    grammar held it)."""
    return 0 if split is None else count_reasoning_tokens(token_ids, split.tags, has_reasoning)

