"""Request (what a client asked for) and Sequence (one of its n samples, as the scheduler sees it)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.params import SamplingParams


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
    allows, renormalised, as vLLM v1 reports them (engine/grammar.py).
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    sequences: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # complete once the first prefill is done
    partial_prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])  # chunk by chunk
    prompt_logprobs_sent: bool = False
    num_finished: int = 0


class Sequence:
    """The scheduler's unit: token ids, how many have KV in the cache, and the blocks holding them."""

    def __init__(self, seq_id: int, request: Request, index: int, generator: torch.Generator, output_text) -> None:
        self.seq_id = seq_id
        self.request = request
        self.index = index  # choice index among the request's n samples
        self.token_ids: list[int] = list(request.prompt_ids)
        self.num_prompt_tokens = len(request.prompt_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # content hash of each full block of block_table (prefix caching)
        self.status = SequenceStatus.WAITING
        self.generator = generator
        self.output_text = output_text  # engine.stops.OutputText
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
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        # One sample per request computes them, once; a recomputation after preemption does not.
        return self.params.prompt_logprobs is not None and self.index == 0 and self.request.prompt_logprobs is None
