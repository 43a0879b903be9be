"""Greedy tokens and logprobs of the engine match transformers, alone and batched, on real and tiny models."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child in two sentences.",
    "List three prime numbers and say why they are prime.",
    "Translate 'good morning' into Spanish, French and German, then tell me a short story about a sailor.",
]


def _chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


def _hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int, eos=None) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="module")
def hf_default(default_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(default_tokenizer):
    return [_chat_ids(default_tokenizer, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_reference(hf_default, prompt_ids):
    eos = hf_default.generation_config.eos_token_id
    return [_hf_greedy(hf_default, ids, 64, eos) for ids in prompt_ids]


@pytest.mark.slow
def test_default_model_answers_like_a_real_model(default_engine, default_tokenizer):
    ids = _chat_ids(default_tokenizer, "What is the capital of France?")
    [completion] = default_engine.generate([ids], SamplingParams(temperature=0, max_tokens=32))
    assert "Paris" in completion.choices[0].text
    assert completion.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_greedy_matches_transformers_one_at_a_time(default_engine, prompt_ids, hf_reference):
    params = SamplingParams(temperature=0, max_tokens=64)
    for ids, expected in zip(prompt_ids, hf_reference):
        [completion] = default_engine.generate([ids], params)
        assert _strip_eos(completion.choices[0].token_ids, default_engine) == _strip_eos(expected, default_engine)


@pytest.mark.slow
def test_greedy_matches_transformers_all_in_one_batch(default_engine, prompt_ids, hf_reference):
    completions = default_engine.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=64))
    for completion, expected in zip(completions, hf_reference):
        assert _strip_eos(completion.choices[0].token_ids, default_engine) == _strip_eos(expected, default_engine)


@pytest.mark.slow
def test_logprobs_match_transformers_forward(default_engine, hf_default, prompt_ids):
    ids = prompt_ids[1]
    [completion] = default_engine.generate([ids], SamplingParams(temperature=0, max_tokens=16, logprobs=5, prompt_logprobs=5))
    choice = completion.choices[0]
    full = ids + choice.token_ids
    with torch.inference_mode():
        reference = torch.log_softmax(hf_default(torch.tensor([full])).logits[0].float(), dim=-1)
    # Prompt logprobs: position p scores token p from the logits at p - 1; the first has none.
    assert completion.prompt_logprobs[0] is None
    for position, entry in enumerate(completion.prompt_logprobs[1:], start=1):
        assert entry.token_id == full[position]
        assert abs(entry.logprob - reference[position - 1, full[position]].item()) < 1e-3
    for step, entry in enumerate(choice.logprobs):
        row = reference[len(ids) + step - 1]
        assert abs(entry.logprob - row[entry.token_id].item()) < 1e-3
        assert entry.logprob <= 0
        top_ids = [t for t, _ in entry.top]
        assert top_ids[0] == entry.token_id  # greedy: the sampled token is the best one
        assert top_ids == row.topk(5).indices.tolist()


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral", "gpt2"])
def test_tiny_architectures_match_transformers(tiny_engine_factory, model_type):
    """Native path for the Llama family, the generic transformers path for GPT-2; alone and batched."""
    engine, hf_model = tiny_engine_factory(model_type)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in (5, 17, 33)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [_hf_greedy(hf_model, p, 12, eos=[]) for p in prompts]
    batched = engine.generate(prompts, params)
    for prompt, completion, reference in zip(prompts, batched, expected):
        assert completion.choices[0].token_ids == reference
        [alone] = engine.generate([prompt], params)
        assert alone.choices[0].token_ids == reference
    assert engine.loaded.is_native == (model_type != "gpt2")


def _strip_eos(token_ids: list[int], engine) -> list[int]:
    """transformers keeps the EOS it stopped on; compare up to it."""
    for i, token_id in enumerate(token_ids):
        if token_id in engine.tokenizer.eos_ids:
            return token_ids[:i]
    return token_ids
