"""SamplingParams: how one request is decoded and stopped, with range checks at construction."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine.text.grammar import Grammar

MAX_LOGPROBS = 20
# Bounds on what one request may make every step do: each stop string is searched for after every token, and each
# logit_bias entry and stop token id is applied or checked row by row, on the one thread all requests share.
MAX_STOP_STRINGS = 16  # OpenAI takes 4; lm-evaluation-harness sends a task's `until` list plus EOS, uncapped
MAX_STOP_LENGTH = 512  # characters per stop string
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
# Below this temperature sampling is greedy (vLLM's threshold): dividing by it would overflow the logits to
# infinities, whose softmax is NaN, and the draw would return token 0.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to the end of the context
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) means no top-k cut
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob plus k alternatives
    prompt_logprobs: int | None = None  # None: none; k >= 0: logprobs of every prompt token plus k alternatives
    skip_special_tokens: bool = True
    grammar: Grammar | None = None  # structured output (engine/text/grammar.py): tokens it does not allow are masked

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _check(self.n >= 1, "n must be at least 1", "n")
        _check(self.max_tokens is None or self.max_tokens >= 0, "max_tokens must be non-negative", "max_tokens")
        _check(self.min_tokens >= 0, "min_tokens must be non-negative", "min_tokens")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens must not exceed max_tokens",
            "min_tokens",
        )
        _check(0.0 <= self.temperature <= 2.0, "temperature must be between 0 and 2", "temperature")
        _check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", "top_p")
        _check(self.top_k >= 0, "top_k must be -1, 0 or positive", "top_k")
        _check(0.0 <= self.min_p <= 1.0, "min_p must be between 0 and 1", "min_p")
        _check(self.repetition_penalty > 0.0, "repetition_penalty must be positive", "repetition_penalty")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be between -2 and 2", "presence_penalty")
        _check(
            -2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be between -2 and 2", "frequency_penalty"
        )
        for token_id, bias in self.logit_bias.items():
            _check(-100.0 <= bias <= 100.0, "logit_bias values must be between -100 and 100", "logit_bias")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or 0 <= value <= MAX_LOGPROBS, f"{name} must be between 0 and {MAX_LOGPROBS}", name
            )
        _check(all(s for s in self.stop), "stop strings must not be empty", "stop")
        _check(len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}", "stop")
        longest = max((len(s) for s in self.stop), default=0)
        _check(longest <= MAX_STOP_LENGTH, f"stop strings must be at most {MAX_STOP_LENGTH} characters, got one of "
               f"{longest}", "stop")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
               f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(self.stop_token_ids)}", "stop_token_ids")
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS,
               f"at most {MAX_LOGIT_BIAS} logit_bias entries, got {len(self.logit_bias)}", "logit_bias")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
        )

    @property
    def has_truncation(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param)
