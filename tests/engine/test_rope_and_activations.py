"""The RoPE tables and activations the Llama family computes without importing transformers' modeling code (to
start faster) are transformers' own, bit for bit, for every RoPE type computed that way and every activation named."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from engine.models.llama import activation, llama_rope_tables, rope_tables, static_rope_tables

ROPE_CONFIGS = {
    "default": dict(hidden_size=64, num_attention_heads=4, rope_theta=10000.0),
    "llama3": dict(hidden_size=128, num_attention_heads=4, max_position_embeddings=131072, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "linear": dict(hidden_size=128, num_attention_heads=2, head_dim=64,
                   rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "yarn": dict(hidden_size=128, num_attention_heads=2, max_position_embeddings=8192, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 2048}),
    "dynamic": dict(hidden_size=64, num_attention_heads=4,  # from the module itself
                    rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
}


@pytest.mark.parametrize("rope_type", ROPE_CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_rope_tables_are_transformers_own(rope_type, dtype):
    config = LlamaConfig(**ROPE_CONFIGS[rope_type])
    theirs = rope_tables(LlamaRotaryEmbedding(config), 4096, "cpu", dtype)
    mine = llama_rope_tables(config, 4096, "cpu", dtype)
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])


GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}


@pytest.mark.parametrize("model_type", ["gemma", "gemma2", "gemma3_text"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rope_tables_are_transformers_own(model_type, dtype):
    from transformers import AutoConfig
    from transformers.models.gemma.modeling_gemma import GemmaRotaryEmbedding
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RotaryEmbedding
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    extra = dict(rope_parameters=GEMMA3_ROPE, layer_types=["sliding_attention", "full_attention"],
                 num_hidden_layers=2) if model_type == "gemma3_text" else dict(rope_theta=10000.0)
    config = AutoConfig.for_model(model_type, hidden_size=256, num_attention_heads=4, head_dim=64, **extra)
    rotary = {"gemma": GemmaRotaryEmbedding, "gemma2": Gemma2RotaryEmbedding,
              "gemma3_text": Gemma3RotaryEmbedding}[model_type](config)
    for layer_type in ("sliding_attention", "full_attention") if model_type == "gemma3_text" else (None,):
        kwargs = {"layer_type": layer_type} if layer_type else {}
        theirs = rope_tables(rotary, 4096, "cpu", dtype, **kwargs)
        mine = static_rope_tables(config, 4096, "cpu", dtype, layer_type)
        assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])


@pytest.mark.parametrize("name", ["silu", "swish", "relu", "gelu", "gelu_pytorch_tanh", "gelu_new"])
def test_activations_are_transformers_own(name):
    x = torch.linspace(-8, 8, 4097)
    assert torch.equal(activation(name)(x), ACT2FN[name](x))
