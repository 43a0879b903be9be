"""The engine on CUDA: the same parity and batching guarantees as on CPU. Skipped where there is no GPU (CI)."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 60, (count,), generator=generator).tolist()
    return [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in lengths]


def _hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt_ids], device="cuda"),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device="cuda"),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=[],
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral", "gpt2"])
def test_greedy_matches_transformers_on_cuda(tiny_engine_factory, model_type):
    engine, hf_model = tiny_engine_factory(model_type, device="cuda")
    assert engine.device.type == "cuda"
    prompts = _prompts(4, seed=1)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    batched = engine.generate(prompts, params)
    for prompt, completion in zip(prompts, batched):
        assert completion.choices[0].token_ids == _hf_greedy(hf_model, prompt, 16)


def test_logprobs_match_transformers_forward_on_cuda(tiny_engine_factory):
    engine, hf_model = tiny_engine_factory("llama", device="cuda")
    prompt = _prompts(1, seed=2)[0]
    [completion] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt], device="cuda")).logits[0].float()
    expected = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(prompt[1:], device="cuda")[:, None])[:, 0]
    ours = torch.tensor([entry.logprob for entry in completion.prompt_logprobs[1:]], device="cuda")
    assert torch.allclose(ours, expected, atol=1e-3)


def test_bf16_and_seeded_sampling_on_cuda(tiny_engine_factory):
    engine, _ = tiny_engine_factory("llama", device="cuda", dtype="bfloat16")
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True)
    target = _prompts(1, seed=3)[0]
    [alone] = engine.generate([target], params)
    in_crowd = engine.generate([*_prompts(5, seed=4), target], params)[-1]
    assert alone.choices[0].token_ids == in_crowd.choices[0].token_ids
    assert len(alone.choices[0].token_ids) == 16
