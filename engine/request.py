"""Request (what a client asked for), its PromptLogprobs, and Sequence (one of its n samples, as the scheduler sees it)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.params import SamplingParams

if TYPE_CHECKING:
    from engine.pooling import PooledEmbedding


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    """Logprob of one token and its top alternatives (token_id, logprob), best first.

    Logprobs are of the model's raw distribution (log-softmax of the logits before temperature, penalties or
    truncation), like vLLM's default: they mean the same whatever the sampling settings, and scoring relies on
    that. Under a grammar (structured output) they are of that distribution restricted to the tokens the grammar
    allows, renormalised, as vLLM v1 reports them (engine/text/grammar.py).
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def token_logprob(row_logprobs: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    """Logprob of token_id in one row of log-softmaxed logits, with the num_top best alternatives."""
    top: list[tuple[int, float]] = []
    if num_top > 0:
        values, ids = row_logprobs.topk(num_top)
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token_id, float(row_logprobs[token_id]), top)


class PromptLogprobs:
    """A request's prompt logprobs (echo, scoring): one entry per prompt token, None for the first (nothing
    predicts it). Filled chunk by chunk as the prompt is prefilled, by one of its samples; sent once, with the
    request's first output after it is complete."""

    def __init__(self, prompt_ids: list[int], num_top: int) -> None:
        self._prompt_ids = prompt_ids
        self._num_top = num_top
        self._entries: list[TokenLogprob | None] = [None]
        self.is_complete = False
        self._is_sent = False

    def add_chunk(self, start: int, chunk_logits: torch.Tensor) -> None:
        """Logits of the prompt positions from `start` on: row p predicts token start+p+1; keep those that are
        prompt tokens. A recomputation after preemption replaces what it recomputes."""
        del self._entries[start + 1 :]
        logprobs = torch.log_softmax(chunk_logits, dim=-1)
        for row in range(logprobs.shape[0]):
            position = start + row + 1
            if position >= len(self._prompt_ids):
                break
            self._entries.append(token_logprob(logprobs[row], self._prompt_ids[position], self._num_top))
        self.is_complete = len(self._entries) >= len(self._prompt_ids)

    def take_for_emit(self) -> list[TokenLogprob | None] | None:
        """All entries, the first time they are asked for once complete; None before and after that."""
        if not self.is_complete or self._is_sent:
            return None
        self._is_sent = True
        return self._entries


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    sequences: list[Sequence] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = field(default=None, init=False)  # None: not asked for
    num_finished: int = 0
    embedding: PooledEmbedding | None = None  # an embedding request (prompt only): its vector, as it is pooled

    def __post_init__(self) -> None:
        num_top = self.params.prompt_logprobs
        self.prompt_logprobs = None if num_top is None else PromptLogprobs(self.prompt_ids, num_top)


class Sequence:
    """The scheduler's unit: token ids, how many have KV in the cache, and the blocks holding them."""

    def __init__(self, seq_id: int, request: Request, index: int, generator: torch.Generator, output_text) -> None:
        self.seq_id = seq_id
        self.request = request
        self.index = index  # choice index among the request's n samples
        self.token_ids: list[int] = list(request.prompt_ids)
        self.num_prompt_tokens = len(request.prompt_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # prompt tokens whose K/V the prefix cache held when it started (not computed)
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # content hash of each full block of block_table (prefix caching)
        self.status = SequenceStatus.WAITING
        self.generator = generator
        self.output_text = output_text  # engine.text.stops.OutputText
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.max_tokens: int = 0  # resolved against the context length at submit
        grammar = request.params.grammar
        self.grammar = grammar.matcher() if grammar is not None else None  # its own position in the grammar
        self.num_preemptions = 0

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def has_token_budget(self) -> bool:
        """Whether max_tokens allows another output token (a prompt-only request, max_tokens 0, never samples)."""
        return self.num_output_tokens < self.max_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        # One sample per request computes them, once; a recomputation after preemption does not.
        prompt_logprobs = self.request.prompt_logprobs
        return prompt_logprobs is not None and self.index == 0 and not prompt_logprobs.is_complete

    @property
    def needs_every_prompt_position(self) -> bool:
        """Whether every prompt position must be computed here (prompt logprobs, mean pooling): a cached prefix,
        whose logits and hidden states were never kept, cannot serve it."""
        embedding = self.request.embedding
        return self.wants_prompt_logprobs or embedding is not None and embedding.needs_every_position

    def wants_hidden_states(self, num_new_tokens: int) -> bool:
        """Whether the final hidden states of its next num_new_tokens positions are pooled into an embedding."""
        embedding = self.request.embedding
        return (embedding is not None and self.index == 0
                and embedding.wants_hidden_states(self.num_computed_tokens, num_new_tokens))
