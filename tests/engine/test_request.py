"""PromptLogprobs on its own: filled chunk by chunk, replaced where a preempted prompt is recomputed, sent once."""
from __future__ import annotations

import torch

from engine.params import SamplingParams
from engine.request import Request, Sequence


def _logits(rows: int, vocab: int = 8) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows))


def test_prompt_logprobs_fill_chunk_by_chunk_and_are_sent_once_complete():
    request = Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=0, prompt_logprobs=2))
    seq = Sequence(0, request, 0, generator=None, output_text=None)
    prompt = request.prompt_logprobs
    assert seq.wants_prompt_logprobs and prompt.take_for_emit() is None
    prompt.add_chunk(0, _logits(3))  # positions 0..2 predict tokens 1..3
    assert not prompt.is_complete and prompt.take_for_emit() is None
    prompt.add_chunk(0, _logits(3))  # preempted: the recomputation replaces what it recomputes
    prompt.add_chunk(3, _logits(2))  # the last row predicts what follows the prompt: not a prompt token
    assert prompt.is_complete and not seq.wants_prompt_logprobs
    entries = prompt.take_for_emit()
    assert entries[0] is None and [e.token_id for e in entries[1:]] == [2, 3, 4, 5]
    assert all(len(e.top) == 2 and e.logprob <= 0 for e in entries[1:])
    assert prompt.take_for_emit() is None  # once per request, whichever sample emits first


def test_only_the_first_sample_computes_prompt_logprobs_and_a_request_without_them_has_none():
    request = Request("r", [1, 2, 3], SamplingParams(n=2, prompt_logprobs=0))
    first, second = (Sequence(i, request, i, generator=None, output_text=None) for i in range(2))
    assert first.wants_prompt_logprobs and not second.wants_prompt_logprobs
    plain = Request("p", [1, 2, 3], SamplingParams())
    assert plain.prompt_logprobs is None
    assert not Sequence(0, plain, 0, generator=None, output_text=None).wants_prompt_logprobs
