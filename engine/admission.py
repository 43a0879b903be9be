"""Admission: what a request must satisfy to be queued (checked on the caller's thread, so a refusal is still a clean
error), and its n samples as the scheduler's Sequences (seed, generator, stop-string matcher, resolved max_tokens)."""
from __future__ import annotations

import itertools
import random

import torch

from engine.errors import ContextLengthExceededError, InvalidRequestError
from engine.params import SamplingParams
from engine.request import Request, Sequence
from engine.text.stops import OutputText
from engine.text.tokens import TokenizerView


def validate_request(prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty", "prompt")
    for name, token_ids in (("prompt", prompt_ids), ("logit_bias", params.logit_bias),
                            ("stop_token_ids", params.stop_token_ids)):
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", name)
    total = len(prompt_ids) + (params.max_tokens or 0)
    if total > max_model_len or len(prompt_ids) >= max_model_len and params.max_tokens != 0:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{total} tokens ({len(prompt_ids)} in the prompt, {params.max_tokens or 0} for the completion). "
            "Please reduce the prompt or the completion length.",
            "prompt" if len(prompt_ids) >= max_model_len else "max_tokens",
        )


class SequenceFactory:
    """Makes a request's samples. Engine thread only: the seed stream of unseeded requests is the engine's own."""

    def __init__(self, tokenizer: TokenizerView, device: torch.device, max_model_len: int, seed: int | None) -> None:
        self._tokenizer = tokenizer
        self._device = device
        self._max_model_len = max_model_len
        self._seq_ids = itertools.count()
        self._seed_rng = random.Random(seed)

    def sequences(self, request: Request) -> list[Sequence]:
        params = request.params
        # No max_tokens: up to the context length (the finish rules also end a sequence there).
        max_tokens = self._max_model_len - len(request.prompt_ids) if params.max_tokens is None else params.max_tokens
        sequences = []
        for index in range(params.n):
            seed = params.seed + index if params.seed is not None else self._seed_rng.getrandbits(63)
            generator = torch.Generator(device=self._device)
            generator.manual_seed(seed)
            text = OutputText(self._tokenizer, params.stop, request.prompt_ids, params.skip_special_tokens)
            seq = Sequence(next(self._seq_ids), request, index, generator, text)
            seq.max_tokens = max_tokens
            sequences.append(seq)
        return sequences
