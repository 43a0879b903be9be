"""A temperature near 0 takes its limit, greedy decoding: dividing by it overflowed the logits to infinities (and
0/0), whose softmax is NaN, and the draw returned token 0 at every step (`temperature: 1e-50` answered "")."""
from __future__ import annotations

from engine import SamplingParams

PROMPT = [5, 17, 301, 42, 7, 900, 12, 64, 3, 77]


def test_a_temperature_near_zero_answers_as_greedy(tiny_engine_factory):
    engine, _ = tiny_engine_factory()
    [greedy] = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for temperature in (1e-6, 1e-30, 1e-300):
        [near] = engine.generate([PROMPT], SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True))
        assert near.choices[0].token_ids == greedy.choices[0].token_ids, temperature

