"""Schemathesis hooks for tests/e2e/test_api_fuzz.py (loaded by `st run` through SCHEMATHESIS_HOOKS).

Generated bodies keep every field the fuzzer picked, except that a generation is cut to a few tokens and samples:
unbounded, a request without max_tokens runs to the end of the context (thousands of tokens, minutes on 2 cores),
and n multiplies it. Values that are already small or of the wrong type are left alone, so negative cases stay
negative.
"""
from __future__ import annotations

import schemathesis

MAX_TOKENS = 4
MAX_SAMPLES = 2
# Route -> the fields that bound how many tokens it generates.
_LENGTH_FIELDS = {
    "/v1/completions": ("max_tokens",),
    "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/v1/responses": ("max_output_tokens",),
    "/v1/messages": ("max_tokens",),
}


@schemathesis.hook
def before_call(context, case, kwargs):
    """Every phase's cases pass here just before they are sent (schemathesis re-checks whether the body still
    breaks the schema after this)."""
    body = case.body
    if not isinstance(body, dict):
        return
    if case.operation.path == "/v1/loglikelihood":
        _pair(body)
    fields = _LENGTH_FIELDS.get(case.operation.path, ())
    if not fields:
        return
    for field in fields:
        value = body.get(field)
        if value is None or _is_int(value) and value > MAX_TOKENS:
            body[field] = MAX_TOKENS
    # min_tokens above max_tokens is refused; keep it within the cut so such requests still generate.
    if _is_int(body.get("min_tokens")) and body["min_tokens"] > MAX_TOKENS:
        body["min_tokens"] = MAX_TOKENS
    # Each sample is a sequence of its own: 16 of them (the most n may be) cost 16 prefills and decodes.
    for field in ("n", "best_of"):
        if _is_int(body.get(field)) and body[field] > MAX_SAMPLES:
            body[field] = MAX_SAMPLES


def _pair(body: dict) -> None:
    """Lists of unequal lengths are refused before scoring: cut them to one length, or scoring is seldom reached."""
    prompts, continuations = body.get("prompts"), body.get("continuations")
    if isinstance(prompts, list) and isinstance(continuations, list) and min(len(prompts), len(continuations)) > 0:
        length = min(len(prompts), len(continuations))
        body["prompts"], body["continuations"] = prompts[:length], continuations[:length]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
