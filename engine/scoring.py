"""Scoring (lm-evaluation-harness's loglikelihood): a continuation's log-likelihood after a context, from the
prompt logprobs of one prompt-only request per continuation."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from engine.errors import DrainingError, InvalidRequestError
from engine.outputs import FINISH_ABORT, Completion, ContinuationScore
from engine.params import SamplingParams
from engine.text.tokens import TokenizerView

_PROMPT_ONLY = SamplingParams(max_tokens=0, prompt_logprobs=1)


async def score(complete: Callable[[list[int], SamplingParams], Awaitable[Completion]], tokenizer: TokenizerView,
                context: str | list[int], continuations: list[str | list[int]]) -> list[ContinuationScore]:
    """Each continuation scored after the context, all in one batch: `complete` is Engine.complete."""
    pairs = [split_for_scoring(tokenizer, context, c) for c in continuations]
    completions = await asyncio.gather(*(complete(ctx + cont, _PROMPT_ONLY) for ctx, cont in pairs))
    if any(not c.choices or c.choices[0].finish_reason == FINISH_ABORT for c in completions):
        raise DrainingError("the engine shut down before scoring ended")
    scores = []
    for (ctx, cont), completion in zip(pairs, completions):
        entries = completion.prompt_logprobs[len(ctx) :]
        logprobs = [e.logprob for e in entries]
        top_ids = [e.top[0][0] if e.top else e.token_id for e in entries]
        greedy = all(not e.top or e.logprob >= e.top[0][1] for e in entries)
        scores.append(ContinuationScore(sum(logprobs), greedy, cont, logprobs, top_ids))
    return scores


def split_for_scoring(tokenizer: TokenizerView, context: str | list[int],
                      continuation: str | list[int]) -> tuple[list[int], list[int]]:
    """Tokenize as lm-evaluation-harness does: the pair together, context boundary from the context alone.
    Either side may be token ids instead (then used as given); neither may come out empty."""
    if not isinstance(context, str) or not isinstance(continuation, str):
        ctx = list(context) if not isinstance(context, str) else tokenizer.encode(context)
        cont = list(continuation) if not isinstance(continuation, str) else tokenizer.encode(continuation, False)
    else:
        trailing = len(context) - len(context.rstrip())
        if trailing:  # a context's trailing space belongs to the continuation's first token
            context, continuation = context[:-trailing], context[-trailing:] + continuation
        ctx = tokenizer.encode(context)
        cont = tokenizer.encode(context + continuation)[len(ctx) :]
    if not ctx:  # the first token of a sequence has no likelihood: something must come before the continuation
        raise InvalidRequestError("the context must not be empty: the first token has no likelihood", "prompt")
    if not cont:
        message = "a continuation is empty"
        if isinstance(continuation, str) and continuation:
            message = ("a continuation has no tokens of its own: tokenized after its context it merges into the "
                       "context's last token (split the pair at a word boundary, or send token ids)")
        raise InvalidRequestError(message, "continuation")
    return ctx, cont
