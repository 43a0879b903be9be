"""Embeddings: how a prompt's final hidden states become one vector (the pooling rule, read once from the checkpoint),
one request's vector as its prompt is prefilled chunk by chunk, and embed(), which serves a batch of inputs."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import DrainingError
from engine.outputs import FINISH_ABORT, Embedding
from engine.stream import RequestStream

logger = logging.getLogger(__name__)

LAST, MEAN, FIRST = "last", "mean", "first"
# sentence-transformers' Pooling module config (1_Pooling/config.json): its flags, by the method that serves them.
_SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_lasttoken": LAST, "pooling_mode_mean_tokens": MEAN,
                                "pooling_mode_cls_token": FIRST}


@dataclass(frozen=True)
class PoolingRule:
    """How the final hidden states (after the final norm) of a prompt become its vector, always L2-normalised:
    `last` (the last token's: in a decoder only it has seen the whole input), `mean` (over every prompt token) or
    `first`. `problem` says why this checkpoint's embeddings cannot be served (then every embedding request is
    refused with it)."""

    method: str
    reason: str
    problem: str | None = None

    @property
    def needs_every_position(self) -> bool:
        """Whether positions before the last one count: then a cached prefix (whose hidden states were never
        computed) cannot be reused."""
        return self.method != LAST


def pooling_rule_for(folder: Path) -> PoolingRule:
    """The rule for a checkpoint: a decoder's last token (as vLLM and llama.cpp pool decoder models), unless the
    folder is a sentence-transformers model whose Pooling module asks for another method."""
    config_path = _sentence_transformers_pooling_config(folder)
    if config_path is None:
        rule = PoolingRule(LAST, "a decoder model: the last token's final hidden state")
    else:
        config = json.loads(config_path.read_text())
        asked = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
        served = [_SENTENCE_TRANSFORMERS_MODES[key] for key in asked if key in _SENTENCE_TRANSFORMERS_MODES]
        if len(asked) == 1 and served:
            rule = PoolingRule(served[0], f"the checkpoint's {config_path.parent.name}/config.json asks for {asked[0]}")
        else:
            rule = PoolingRule(LAST, "unserved", f"this checkpoint pools with {', '.join(asked) or 'no mode'} "
                               f"({config_path}); Tern serves exactly one of {', '.join(_SENTENCE_TRANSFORMERS_MODES)}")
    logger.info("embeddings: %s pooling (%s)", rule.method, rule.problem or rule.reason)
    return rule


class PooledEmbedding:
    """One request's vector, built as its prompt is prefilled: the hidden states of each chunk in, one L2-normalised
    vector out once the prompt is complete. Engine thread only."""

    def __init__(self, rule: PoolingRule, num_prompt_tokens: int) -> None:
        self._rule = rule
        self._num_prompt_tokens = num_prompt_tokens
        self._pooled: torch.Tensor | None = None  # the last (first) row, or the sum of the rows so far
        self._vector: list[float] | None = None
        self._is_sent = False

    @property
    def needs_every_position(self) -> bool:
        return self._rule.needs_every_position

    def wants_hidden_states(self, start: int, num_new: int) -> bool:
        """Whether the chunk of prompt positions start..start+num_new-1 holds rows this vector is pooled from."""
        if self._vector is not None:
            return False
        # Every chunk for the methods that read earlier positions: the last one completes the vector.
        return self._rule.method != LAST or start + num_new == self._num_prompt_tokens

    def add_chunk(self, start: int, hidden: torch.Tensor) -> None:
        """The final hidden states [chunk, H] of the prompt positions from `start` on. A recomputation from 0 (after
        a preemption) starts the pool again."""
        hidden = hidden.float()
        if self._rule.method == LAST:
            self._pooled = hidden[-1].clone()
        elif self._rule.method == FIRST:
            if start == 0:
                self._pooled = hidden[0].clone()
        else:
            chunk_sum = hidden.sum(dim=0)
            self._pooled = chunk_sum if start == 0 or self._pooled is None else self._pooled + chunk_sum
        if start + hidden.shape[0] >= self._num_prompt_tokens:
            pooled = self._pooled / self._num_prompt_tokens if self._rule.method == MEAN else self._pooled
            self._vector = torch.nn.functional.normalize(pooled, dim=0).cpu().tolist()

    def take_for_emit(self) -> list[float] | None:
        """The vector, the first time it is asked for once complete; None before and after that."""
        if self._vector is None or self._is_sent:
            return None
        self._is_sent = True
        return self._vector


async def embed(submit: Callable[[str | list[int]], RequestStream], prompts: list[str | list[int]]) -> list[Embedding]:
    """One vector per prompt, all submitted at once so the engine batches them (`submit` is Engine.submit_embedding).
    All or none: a refusal (full queue, bad input) aborts those already queued. Cancelling aborts them too."""
    streams: list[RequestStream] = []
    try:
        for prompt_ids in prompts:
            streams.append(submit(prompt_ids))
        completions = await asyncio.gather(*(stream.completion() for stream in streams))
    finally:
        for stream in streams:
            stream.close()  # no-op for those that ended
    if any(not c.choices or c.choices[0].finish_reason == FINISH_ABORT for c in completions):
        raise DrainingError("the engine shut down before the embeddings were computed")
    if any(c.embedding is None for c in completions):  # a runner that returned no hidden states for a row asking
        raise RuntimeError("an embedding request ended without its vector")
    return [Embedding(c.embedding, c.num_prompt_tokens) for c in completions]


def _sentence_transformers_pooling_config(folder: Path) -> Path | None:
    modules_path = folder / "modules.json"
    if not modules_path.is_file():
        return None
    for module in json.loads(modules_path.read_text()):
        if str(module.get("type", "")).endswith("Pooling"):
            config_path = folder / module.get("path", "") / "config.json"
            return config_path if config_path.is_file() else None
    return None

