"""POST /v1/completions: text or token-id prompts (batched), echo, and legacy logprobs with text offsets."""
from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from functools import cache

from fastapi import APIRouter, Request

from engine import Engine, RequestOutput

from api.errors import OpenAIError
from api.generation import Generation, Sample, until_disconnected
from api.logprobs import completion_logprobs, merge_logprobs, text_offsets
from api.protocol import CompletionRequest
from api.response_format import chat_format, grammar_for
from api.bodies import CompletionChoice, TextCompletion, streamed
from api.route_context import RouteContext
from api.sse import event_stream


def add_routes(router: APIRouter, context: RouteContext) -> None:
    @router.post(
        "/v1/completions",
        response_model=TextCompletion,
        responses=streamed(TextCompletion),
        summary="Create a completion",
    )
    async def create_completion(body: CompletionRequest, request: Request):
        served = await context.serve(body.model)
        engine = served.engine
        params = body.to_sampling_params()
        prompts = body.prompts()
        if body.suffix is not None:
            prompt_ids = _fill_in_middle_prompts(engine, prompts, body.suffix, bool(body.echo))
        else:  # text is tokenized as the engine would (with the tokenizer's special tokens); token ids used as given
            prompt_ids = [engine.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
        params = dataclasses.replace(params, grammar=await grammar_for(engine, chat_format(body.response_format)))
        response_id = f"cmpl-{uuid.uuid4().hex}"
        generation = Generation(engine, prompt_ids, params, response_id, served.metrics, request.state.request_id)
        choices = _Choices(body, prompts, generation, engine)
        head = {"id": response_id, "created": int(time.time()), "model": served.model_id}
        if body.stream:
            return event_stream(_chunks(generation, choices, head, body.include_usage))
        samples = await until_disconnected(request, generation.collect())
        return TextCompletion(**head, choices=[choices.full(s) for s in samples], usage=generation.usage())


def _fill_in_middle_prompts(engine: Engine, prompts: list, suffix: str, echo: bool) -> list[list[int]]:
    """Each prompt as the prefix of a fill-in-the-middle prompt (engine/text/fill_in_middle.py): the completion is
    the text between it and the suffix. echo is refused beside it (a choice: OpenAI's notes here say nothing, vLLM
    refuses suffix altogether): the echoed prompt would read as if the completion ended the text, the suffix nowhere."""
    fim = engine.tokenizer.fim_tokens
    if fim is None:
        message = ("suffix (fill-in-the-middle) needs a model whose vocabulary has FIM tokens (<fim_prefix>, "
                   "<fim_suffix>, <fim_middle> or <|fim_prefix|>, ...); this model has none")
        raise OpenAIError(400, message, param="suffix", code="unsupported_parameter")
    if echo:
        raise OpenAIError(400, "echo cannot be combined with suffix", param="echo", code="unsupported_parameter")
    return [engine.tokenizer.fim_prompt_ids(fim, prompt, suffix) for prompt in prompts]


class _Choices:
    """Samples as completion choices: the echoed prompt in front, logprobs with offsets into prompt + text."""

    def __init__(self, body: CompletionRequest, prompts: list, generation: Generation, engine: Engine) -> None:
        self.echo, self.want_logprobs = bool(body.echo), body.logprobs is not None
        self.prompts, self.generation, self.tokenizer = prompts, generation, engine.tokenizer
        self.prompt_text = cache(self._prompt_text)
        self._prompt_logprobs: dict[int, dict] = {}  # per prompt, shared by its n choices
        self._echoed: set[int] = set()  # choices whose stream has carried the echo

    def full(self, sample: Sample) -> CompletionChoice:
        text, logprobs = self._part(sample, 0, with_echo=self.echo)
        return CompletionChoice(index=sample.index, text=text, logprobs=logprobs, finish_reason=sample.finish_reason)

    def delta(self, sample: Sample, out: RequestOutput) -> CompletionChoice:
        """The choice of one streamed chunk: this output's text and tokens (the echo goes with a choice's first)."""
        with_echo = self.echo and sample.index not in self._echoed
        self._echoed.add(sample.index)
        text, logprobs = self._part(sample, len(sample.token_ids) - len(out.token_ids), with_echo, out.text)
        return CompletionChoice(index=sample.index, text=text, logprobs=logprobs, finish_reason=out.finish_reason)

    def _part(self, sample: Sample, first: int, with_echo: bool, text: str | None = None) -> tuple[str, dict | None]:
        text = sample.text if text is None else text
        logprobs = None
        if self.want_logprobs:
            # Offsets count from the start of the prompt, echoed or not, as OpenAI's legacy API counts them: a client
            # finds a token in prompt + text the same way whether it asked for the echo.
            start = len(self.prompt_text(sample.prompt_index))
            offsets = [start + offset for offset in sample.text_offsets[first:]]
            logprobs = completion_logprobs(sample.token_ids[first:], (sample.logprobs or [])[first:], offsets, self.tokenizer)
            if with_echo:
                logprobs = merge_logprobs(self.prompt_logprobs(sample.prompt_index), logprobs)
        return (self.prompt_text(sample.prompt_index) + text if with_echo else text), logprobs

    def _prompt_text(self, prompt_index: int) -> str:
        prompt = self.prompts[prompt_index]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt, skip_special_tokens=False)

    def prompt_logprobs(self, prompt_index: int) -> dict:
        if prompt_index in self._prompt_logprobs:
            return self._prompt_logprobs[prompt_index]
        prompt_ids = self.generation.prompts[prompt_index]
        entries = self.generation.prompt_logprobs[prompt_index]
        # Offsets into the echoed text: a text prompt is echoed as sent, so special tokens the tokenizer added
        # (a BOS) take no room; token ids are echoed as decoded, special tokens shown.
        is_text = isinstance(self.prompts[prompt_index], str)
        offsets = text_offsets(self.tokenizer, prompt_ids, skip_special_tokens=is_text)
        logprobs = completion_logprobs(prompt_ids, entries or [None] * len(prompt_ids), offsets, self.tokenizer)
        if entries is not None:  # else not computed yet (another sample of a stream ran ahead): nulls this once
            self._prompt_logprobs[prompt_index] = logprobs
        return logprobs


async def _chunks(generation: Generation, choices: _Choices, head: dict,
                  include_usage: bool) -> AsyncIterator[TextCompletion]:
    """Streamed completions share the non-streamed shape (the same model): one choice per chunk, finish_reason on a
    choice's last; without include_usage the chunks carry no usage at all."""
    base = {**head, "object": "text_completion"}
    usage = {"usage": None} if include_usage else {}
    try:
        async for sample, out in generation.outputs():
            choice = choices.delta(sample, out)
            if choice.text or choice.logprobs or choice.finish_reason:
                yield TextCompletion(**base, choices=[choice], **usage)
        if include_usage:
            yield TextCompletion(**base, choices=[], usage=generation.usage())
    finally:
        generation.abort()  # a client gone before the first output never entered outputs()
