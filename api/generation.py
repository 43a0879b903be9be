"""Generation: the engine requests behind one API call, submitted all-or-none, merged, timed, aborted when dropped."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request

from engine import FINISH_ABORT, Choice, Engine, RequestOutput, SamplingParams, TokenLogprob

from api.errors import ClientDisconnected, shutting_down
from api.metrics import Metrics

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Sample(Choice):
    """One choice of an API answer as it accumulates; `index` is prompt_index * n + sample_index."""

    prompt_index: int = 0


class Generation:
    """One engine request per prompt (each with n samples). Outputs of all of them arrive as one stream."""

    def __init__(
        self,
        engine: Engine,
        prompts: list[list[int]],
        params: SamplingParams,
        response_id: str,
        metrics: Metrics,
        request_id: str = "",
    ) -> None:
        self.engine, self.params, self.response_id, self.metrics = engine, params, response_id, metrics
        self.request_id = request_id  # the X-Request-ID, for the log line
        self.prompts = prompts
        self.samples = [Sample(p * params.n + i, prompt_index=p) for p in range(len(prompts)) for i in range(params.n)]
        self.prompt_logprobs: list[list[TokenLogprob | None] | None] = [None] * len(prompts)
        self._cached_tokens = [0] * len(prompts)  # per prompt, as its first sample found the prefix cache
        self._started_at = time.monotonic()
        self._last_token_at: dict[int, float] = {}
        self._streams = []
        try:
            for p, prompt_ids in enumerate(prompts):
                request_id = response_id if len(prompts) == 1 else f"{response_id}-{p}"
                self._streams.append(engine.submit(prompt_ids, params, request_id))
        except BaseException:  # refuse all (429, 400) rather than answer some prompts
            self.abort()
            raise
        metrics.prompt_tokens.inc(sum(len(p) for p in prompts))

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (OpenAI's usage.prompt_tokens_details.cached_tokens)."""
        return sum(self._cached_tokens)

    def usage(self) -> dict:
        prompt, completion = self.num_prompt_tokens, self.num_completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens}}

    async def outputs(self) -> AsyncIterator[tuple[Sample, RequestOutput]]:
        """Each engine output once it is added to its sample. Leaving early (client gone) aborts what is left."""
        source = _merge(self._streams) if len(self._streams) > 1 else _single(self._streams[0])
        try:
            async for prompt_index, out in source:
                if out.prompt_logprobs is not None:
                    self.prompt_logprobs[prompt_index] = out.prompt_logprobs
                if out.index == 0:
                    self._cached_tokens[prompt_index] = out.num_cached_tokens
                sample = self.samples[prompt_index * self.params.n + out.index]
                sample.add(out)
                self._observe(sample, out)
                yield sample, out
        finally:
            self.abort()
            finishes = [s.finish_reason for s in self.samples]
            logger.info(
                "%s %s: %d prompt + %d completion tokens, finish %s",
                self.request_id, self.response_id, self.num_prompt_tokens, self.num_completion_tokens,
                ",".join(f or "aborted" for f in finishes),
            )

    async def collect(self) -> list[Sample]:
        """Every sample to its end. One the engine cut short at shutdown makes the whole answer a 503: a client
        that waited for one JSON body would otherwise take a half answer for a whole one."""
        async for _ in self.outputs():
            pass
        if any(sample.finish_reason == FINISH_ABORT for sample in self.samples):
            raise shutting_down("the server shut down before this request finished; retry it")
        return self.samples

    def abort(self) -> None:
        """Abort every engine request not finished yet: the engine frees their KV blocks at its next step."""
        for stream in self._streams:
            stream.close()

    def _observe(self, sample: Sample, out: RequestOutput) -> None:
        now = time.monotonic()
        if out.token_ids:
            self.metrics.completion_tokens.inc(len(out.token_ids))
            last = self._last_token_at.get(sample.index)
            if last is None:
                self.metrics.time_to_first_token.observe(now - self._started_at)
            else:
                self.metrics.inter_token_latency.observe((now - last) / len(out.token_ids))
            self._last_token_at[sample.index] = now
        if out.finish_reason is not None:
            self.metrics.e2e_latency.observe(now - self._started_at)


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await work unless the client disconnects first; then cancel it (which aborts its engine requests).

    Starlette cancels a streaming response by itself when its client goes; a plain response needs this."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        work_task.cancel()  # no-op once done
    if work_task in done:
        return work_task.result()
    raise ClientDisconnected()


async def _disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _single(stream) -> AsyncIterator[tuple[int, RequestOutput]]:
    async for out in stream:
        yield 0, out


async def _merge(streams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams in arrival order, tagged with the stream's position."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(position: int, stream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((position, out))
            queue.put_nowait((position, end))
        except Exception as exc:  # delivered to the consumer, in order
            queue.put_nowait((position, exc))

    tasks = [asyncio.create_task(pump(p, s)) for p, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            position, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()
