"""The sampler on hand-made logits, held to a plain reference written here: penalties and logit_bias, temperature,
top-k, top-p and min-p at ordinary values, the order they apply in, greedy picks and the draw itself.

The reference follows vLLM's documented order (vllm/v1/sample/sampler.py, the Sampler's docstring): logit_bias, then
the penalties, then temperature, then min-p, then top-k and top-p, each cut measured on what the cuts before it
left.
"""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine import SamplingParams
from engine.request import Request, Sequence
from engine.sampler import adjust_logits, sample, to_probabilities

EOS_IDS = frozenset({7})
# Eight tokens, positive and negative logits, no two equal: every cut below has one right answer.
LOGITS = [1.0, 3.0, -1.0, 2.0, 0.0, 1.5, -2.5, 0.5]
PROMPT_IDS = [0, 2, 2]  # 0 and 2 are seen in the prompt only
OUTPUT_IDS = [5, 1, 5, 5, 6]  # 5 three times, 1 and 6 once


def _seq(prompt_ids=PROMPT_IDS, output_ids=OUTPUT_IDS, seed: int = 0, **params) -> Sequence:
    """A real Sequence as the engine builds one, with output_ids already generated."""
    request = Request("r", list(prompt_ids), SamplingParams(**params))
    seq = Sequence(0, request, 0, torch.Generator().manual_seed(seed), output_text=None)
    seq.token_ids.extend(output_ids)
    return seq


def _softmax(logits: list[float]) -> list[float]:
    top = max(x for x in logits if x != -math.inf)
    weights = [0.0 if x == -math.inf else math.exp(x - top) for x in logits]
    total = sum(weights)
    return [w / total for w in weights]


def _reference_adjusted(logits, prompt_ids=PROMPT_IDS, output_ids=OUTPUT_IDS, repetition_penalty=1.0,
                        presence_penalty=0.0, frequency_penalty=0.0, logit_bias=None) -> list[float]:
    """The penalties as vLLM and OpenAI define them: repetition over prompt and output (a positive logit divided by
    it, a negative one multiplied); frequency once per occurrence and presence once, over the output only; logit_bias
    before all of them, as vLLM adds it."""
    logit_bias = logit_bias or {}
    seen = set(prompt_ids) | set(output_ids)
    adjusted = []
    for token_id, x in enumerate(logits):
        x += logit_bias.get(token_id, 0.0)
        if token_id in seen:
            x = x / repetition_penalty if x > 0 else x * repetition_penalty
        count = output_ids.count(token_id)
        x -= frequency_penalty * count
        if count:
            x -= presence_penalty
        adjusted.append(x)
    return adjusted


def _reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> list[float]:
    """The distribution to draw from: temperature, then min-p, top-k and top-p, each on what is left before it."""
    probs = _softmax([x / temperature for x in logits])
    by_prob = sorted(range(len(probs)), key=lambda t: -probs[t])
    kept = [t for t in by_prob if probs[t] >= min_p * probs[by_prob[0]]]
    if top_k:
        kept = kept[:top_k]
    if top_p < 1.0:
        # The smallest set of the most likely tokens whose (renormalised) mass reaches top_p.
        left = sum(probs[t] for t in kept)
        chosen, mass = [], 0.0
        for t in kept:
            if mass >= top_p:
                break
            chosen.append(t)
            mass += probs[t] / left
        kept = chosen
    total = sum(probs[t] for t in kept)
    return [probs[t] / total if t in kept else 0.0 for t in range(len(probs))]


def _support(probs) -> set[int]:
    return {t for t, p in enumerate(probs) if p > 0}


def _row(values) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


# Penalties and logit_bias


@pytest.mark.parametrize("params", [
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.8),  # below 1 it favours what was seen
    dict(presence_penalty=0.8),
    dict(presence_penalty=-0.5),
    dict(frequency_penalty=0.6),
    dict(frequency_penalty=-0.4),
    dict(logit_bias={3: -5.0, 6: 4.0}),
    dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25),
    dict(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={0: 2.0, 4: -1.0}),
], ids=lambda params: ",".join(params))
def test_penalties_and_logit_bias_change_logits_as_defined(params):
    expected = _reference_adjusted(LOGITS, **params)
    assert expected != LOGITS  # the case exercises what it names
    adjusted = adjust_logits(_row(LOGITS), [_seq(**params)], EOS_IDS)
    assert adjusted[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_each_row_gets_its_own_penalties_and_others_are_untouched():
    plain = _seq()
    penalised = _seq(output_ids=[1, 1], presence_penalty=1.0, frequency_penalty=0.5)
    biased = _seq(logit_bias={2: 3.0})
    logits = torch.tensor([LOGITS] * 3, dtype=torch.float32)
    adjusted = adjust_logits(logits, [plain, penalised, biased], EOS_IDS)
    assert adjusted[0].tolist() == LOGITS
    assert adjusted[1].tolist() == pytest.approx(
        _reference_adjusted(LOGITS, output_ids=[1, 1], presence_penalty=1.0, frequency_penalty=0.5), abs=1e-6)
    assert adjusted[2].tolist() == pytest.approx(_reference_adjusted(LOGITS, logit_bias={2: 3.0}), abs=1e-6)
    assert logits.tolist() == [LOGITS] * 3  # the caller's logits (the runner's buffer) are left as they were


def test_logit_bias_applies_before_the_repetition_penalty_as_in_vllm():
    # Token 0 (logit 1.0, seen): biased by -2 to -1.0, then the penalty multiplies it to -2.0. Added after the
    # penalty (Tern's order until this test), it would be 1.0 / 2 - 2 = -1.5.
    params = dict(repetition_penalty=2.0, logit_bias={0: -2.0, 1: 1.0})
    adjusted = adjust_logits(_row(LOGITS), [_seq(**params)], EOS_IDS)
    assert adjusted[0, 0].item() == pytest.approx(-2.0)
    assert adjusted[0].tolist() == pytest.approx(_reference_adjusted(LOGITS, **params), abs=1e-6)


# Temperature and truncation


@pytest.mark.parametrize("params", [
    dict(temperature=0.7),
    dict(temperature=1.6),
    dict(top_k=3),
    dict(top_p=0.7),  # 0.532 + 0.196 = 0.727: the two most likely tokens, not one and not three
    dict(top_p=0.95),
    dict(min_p=0.1),  # keeps p >= 0.0532: four tokens
    dict(temperature=0.5, min_p=0.02),
    dict(top_k=5, min_p=0.1),  # min-p is relative to the best token, so either order keeps the same four
], ids=lambda params: ",".join(f"{k}={v}" for k, v in params.items()))
def test_truncation_keeps_the_reference_tokens_with_renormalised_probabilities(params):
    expected = _reference_probs(LOGITS, **params)
    probs = to_probabilities(_row(LOGITS), [_seq(**params)])[0].tolist()
    assert _support(probs) == _support(expected)
    assert probs == pytest.approx(expected, abs=1e-6)


def test_temperature_applies_before_top_p():
    # At temperature 2 the distribution is flatter: the 0.7 mass takes four tokens (0.659 after three), where the
    # temperature-1 distribution reaches it with two. vLLM and transformers both scale first, then cut.
    params = dict(temperature=2.0, top_p=0.7)
    expected = _reference_probs(LOGITS, **params)
    cut_first = _support(_reference_probs(LOGITS, top_p=0.7))
    assert len(_support(expected)) == 4 and len(cut_first) == 2
    probs = to_probabilities(_row(LOGITS), [_seq(**params)])[0].tolist()
    assert _support(probs) == _support(expected)
    assert probs == pytest.approx(expected, abs=1e-6)


def test_each_row_gets_its_own_temperature_and_cuts():
    settings = [dict(), dict(top_k=2), dict(top_p=0.7, temperature=0.5), dict(min_p=0.3), dict(temperature=1.8)]
    logits = torch.tensor([LOGITS] * len(settings), dtype=torch.float32)
    probs = to_probabilities(logits, [_seq(**params) for params in settings])
    for row, params in zip(probs.tolist(), settings):
        assert row == pytest.approx(_reference_probs(LOGITS, **params), abs=1e-6), params


@pytest.mark.parametrize("params", [dict(top_k=2, top_p=0.5), dict(min_p=0.6, top_p=0.5)])
def test_top_p_is_measured_on_what_top_k_and_min_p_left_as_in_vllm(params):
    probs4 = [0.4, 0.3, 0.2, 0.1]
    logits = [math.log(p) for p in probs4]
    # top_k 2 (or min_p 0.6) leaves 0.4 and 0.3, renormalised 0.571 and 0.429: top_p 0.5 then keeps one token.
    expected = _reference_probs(logits, **params)
    assert _support(expected) == {0}
    probs = to_probabilities(_row(logits), [_seq(**params)])[0].tolist()
    assert _support(probs) == _support(expected)


# Through sample(): greedy picks, the order of its stages, the draw


@pytest.mark.parametrize("params", [
    dict(repetition_penalty=3.0),  # 1 (3.0 -> 1.0) falls behind 3 (2.0, never seen)
    dict(presence_penalty=1.5),  # 1 (3.0 -> 1.5) falls behind 3
    dict(frequency_penalty=1.2),  # 1 (3.0 -> 1.8) falls behind 3
    dict(logit_bias={4: 3.5}),  # 4 (0.0 -> 3.5) overtakes 1
    dict(logit_bias={1: -100.0}),  # OpenAI's "ban this token"
], ids=lambda params: ",".join(params))
def test_greedy_takes_the_argmax_after_penalties_and_bias(params):
    seq = _seq(temperature=0, **params)
    adjusted = _reference_adjusted(LOGITS, **params)
    expected = max(range(len(adjusted)), key=lambda t: adjusted[t])
    assert expected != max(range(len(LOGITS)), key=lambda t: LOGITS[t])  # the adjustment moves the argmax
    [(token_id, logprob)] = sample(_row(LOGITS), [seq], EOS_IDS)
    assert token_id == expected and logprob is None


def test_penalties_apply_before_truncation_in_what_is_drawn():
    # Token 1 leads by a logit; a presence penalty of 2 on it (it was generated) drops it to third, so top_k=2 must
    # keep 3 and 5, and 1 is never drawn. Truncating first would have kept 1 and 3.
    params = dict(presence_penalty=2.0, top_k=2)
    seq = _seq(output_ids=[1], **params)
    allowed = _support(_reference_probs(_reference_adjusted(LOGITS, output_ids=[1], presence_penalty=2.0), top_k=2))
    assert allowed == {3, 5} and allowed != _support(_reference_probs(LOGITS, top_k=2))
    draws = [token_id for token_id, _ in sample(torch.tensor([LOGITS] * 2000), [seq] * 2000, EOS_IDS)]
    assert set(draws) == allowed


NUM_DRAWS = 40_000
# Five standard errors of a frequency at p = 0.5 (the widest) over NUM_DRAWS draws: sqrt(0.25 / 40000) = 0.0025.
DRAW_TOLERANCE = 5 * math.sqrt(0.25 / NUM_DRAWS)


@pytest.mark.parametrize("params", [dict(temperature=0.8, top_p=0.85), dict(temperature=1.3, min_p=0.05), dict(top_k=4)],
                         ids=lambda params: ",".join(f"{k}={v}" for k, v in params.items()))
def test_draws_follow_the_reference_distribution(params):
    # One sequence in every row: its one generator makes NUM_DRAWS successive draws, as over NUM_DRAWS steps.
    seq = _seq(seed=1234, **params)
    expected = _reference_probs(LOGITS, **params)
    draws = sample(torch.tensor([LOGITS] * NUM_DRAWS), [seq] * NUM_DRAWS, EOS_IDS)
    counts = Counter(token_id for token_id, _ in draws)
    assert set(counts) == _support(expected)  # every allowed token turns up, and no other
    for token_id, p in enumerate(expected):
        assert abs(counts[token_id] / NUM_DRAWS - p) <= DRAW_TOLERANCE, (token_id, counts[token_id] / NUM_DRAWS, p)


def test_rows_drawn_together_draw_what_each_would_alone():
    """A seeded sequence draws the same tokens whatever shares its step: rows of different distributions, greedy ones
    among them, sampled in one call, against each row sampled by itself with a generator seeded alike."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(9, 300, generator=generator) * 3
    params = [dict(temperature=1.0), dict(temperature=0), dict(temperature=0.7, top_p=0.9), dict(top_k=5),
              dict(temperature=1.5, min_p=0.02), dict(temperature=0), dict(temperature=1.0), dict(temperature=0.3),
              dict(temperature=1.0, top_p=0.5)]
    together = [_seq(seed=100 + i, **p) for i, p in enumerate(params)]
    alone = [_seq(seed=100 + i, **p) for i, p in enumerate(params)]
    for step in range(30):
        drawn = [token_id for token_id, _ in sample(logits, together, EOS_IDS)]
        single = [sample(logits[i:i + 1], [seq], EOS_IDS)[0][0] for i, seq in enumerate(alone)]
        assert drawn == single, step
    assert len({token_id for token_id, _ in sample(logits[:1].expand(200, -1), [_seq(seed=1)] * 200, EOS_IDS)}) > 20
