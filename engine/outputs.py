"""What the engine hands back: per-step deltas (RequestOutput) and their accumulation into a Completion."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import TokenLogprob

# The finish_reason of a sample the engine ended itself before it was done (Engine.abort_all, at shutdown). As
# SGLang says it; OpenAI has no name for it, and "length" or "stop" would tell the client something untrue.
FINISH_ABORT = "abort"


@dataclass
class RequestOutput:
    """One step's news for one of a request's samples. Text deltas concatenate to the full output text."""

    request_id: str
    index: int  # which of the request's n samples
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None  # one per token in token_ids, when asked for
    finish_reason: str | None  # "stop" | "length" | FINISH_ABORT on the last delta of this sample, else None
    stop_reason: str | int | None  # the stop string or stop token id that ended it, if any
    num_prompt_tokens: int
    num_output_tokens: int  # so far, for this sample
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first delta, when asked for
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage's cached_tokens)
    embedding: list[float] | None = None  # an embedding request's vector, on its last output (engine/pooling.py)


@dataclass
class Choice:
    """One sample's outputs added up: what the API answers and the UI shows, accumulated in one place."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None  # None unless asked for
    text_offsets: list[int] = field(default_factory=list)  # [i]: len(text) before token i's text was added
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, out: RequestOutput) -> None:
        self.text_offsets += [len(self.text)] * len(out.token_ids)
        self.token_ids += out.token_ids
        self.text += out.text
        if out.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += out.logprobs
        if out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason


@dataclass
class Completion:
    request_id: str
    num_prompt_tokens: int = 0
    choices: list[Choice] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Of the prompt, served from the prefix cache: as the first sample found it (the others of n > 1 reuse the blocks
    # it computed, which is no cache hit for the client).
    num_cached_tokens: int = 0
    embedding: list[float] | None = None

    @property
    def num_output_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def add(self, out: RequestOutput) -> None:
        while len(self.choices) <= out.index:
            self.choices.append(Choice(index=len(self.choices)))
        self.choices[out.index].add(out)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.embedding is not None:
            self.embedding = out.embedding
        self.num_prompt_tokens = out.num_prompt_tokens
        if out.index == 0:
            self.num_cached_tokens = out.num_cached_tokens


@dataclass
class Embedding:
    """One input's vector: L2-normalised, as long as the model's hidden size (pooled as engine/pooling.py says)."""

    vector: list[float]
    num_prompt_tokens: int


@dataclass
class ContinuationScore:
    """Log-likelihood of one continuation given a context (the /v1/loglikelihood contract)."""

    logprob: float  # sum over the continuation's tokens
    is_greedy: bool  # every continuation token was the model's top choice
    token_ids: list[int]
    token_logprobs: list[float]
    top_token_ids: list[int]  # the model's top choice at each continuation position

    @property
    def mean_logprob(self) -> float:
        return self.logprob / max(len(self.token_ids), 1)
