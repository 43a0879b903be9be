"""Engine logprobs in OpenAI's two shapes: chat's `logprobs.content[]` and legacy completions' parallel lists."""
from __future__ import annotations

from engine import TokenLogprob
from engine.text.stops import OutputText

# OpenAI's stand-in for minus infinity (JSON has no infinities).
MIN_LOGPROB = -9999.0


def chat_logprobs(entries: list[TokenLogprob], tokenizer) -> list[dict]:
    """`choices[].logprobs.content` for these tokens; tokenizer is the engine's TokenizerView."""
    return [
        {**_token(entry.token_id, entry.logprob, tokenizer), "top_logprobs": [_token(t, lp, tokenizer) for t, lp in entry.top]}
        for entry in entries
    ]


def visible_logprobs(entries: list[TokenLogprob], finish_reason: str | None, stop_reason) -> list[TokenLogprob]:
    """Chat shows no logprob for the end-of-sequence (or stop) token that ended a sample: it is not in the text."""
    if finish_reason == "stop" and not isinstance(stop_reason, str) and entries:
        return entries[:-1]
    return entries


def completion_logprobs(
    token_ids: list[int], entries: list[TokenLogprob | None], text_offsets: list[int], tokenizer
) -> dict:
    """Legacy `choices[].logprobs` for these tokens. An entry of None (an echoed prompt's first token, which has
    no context) gives null in token_logprobs and top_logprobs. Each top_logprobs dict holds the alternatives and
    the token itself, so max(top.values()) == token_logprob exactly when the token was the model's first choice
    (what lm-evaluation-harness checks for is_greedy)."""
    tokens = [tokenizer.token_text(token_id) for token_id in token_ids]
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    for token, entry in zip(tokens, entries):
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        top: dict[str, float] = {}
        for token_id, logprob in entry.top:  # best first: two ids that decode alike keep the better logprob
            top.setdefault(tokenizer.token_text(token_id), clamp(logprob))
        top.setdefault(token, clamp(entry.logprob))
        token_logprobs.append(clamp(entry.logprob))
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offsets}


def merge_logprobs(first: dict, second: dict) -> dict:
    """An echoed prompt's logprobs followed by the completion's."""
    return {key: first[key] + second[key] for key in first}


def text_offsets(tokenizer, token_ids: list[int], skip_special_tokens: bool, start: int = 0) -> list[int]:
    """Where each token's text begins in decode(token_ids), counted in characters from `start`.

    Incremental detokenizing gives each token the characters it completes, so the offsets add up to the decoded
    text in one pass (decoding every prefix would be quadratic); a token that begins a character split over
    several tokens gets that character's offset; tokenizer is the engine's TokenizerView."""
    output = OutputText(tokenizer, (), None, skip_special_tokens)
    offsets, length = [], start
    for token_id in token_ids:
        offsets.append(length)
        delta, _ = output.append(token_id)
        length += len(delta)
    return offsets


def clamp(logprob: float) -> float:
    return logprob if logprob > MIN_LOGPROB else MIN_LOGPROB  # also maps NaN, which JSON cannot carry either


def _token(token_id: int, logprob: float, tokenizer) -> dict:
    return {"token": tokenizer.token_text(token_id), "logprob": clamp(logprob), "bytes": list(tokenizer.token_bytes(token_id))}
