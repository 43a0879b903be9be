"""Gemma (1, 2, 3) and Phi-3/Phi-4 run natively on the paged KV cache and answer as transformers does.

Each family is a tiny random checkpoint saved as a Hugging Face folder, or written as a GGUF file the way llama.cpp's
converter writes it (Gemma's norms stored plus one, Phi-3's projections fused). Through Tern's Engine two prompts of
different lengths decode together, greedy in float32, and get transformers' tokens and logprobs. The prompts are
longer than the sliding window (8), so a layer that attended past it would answer differently; the weights are
larger than transformers' default init so that attention is far from uniform and soft-caps and RoPE matter.
"""
from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import (assert_config_reads_back, assert_tokenizer_as_autotokenizer, heavy_imports_of_a_start, tiny_config,
                      tokenizer_fields)

from engine import Engine, EngineConfig, SamplingParams

SLIDING, FULL = "sliding_attention", "full_attention"
FAMILIES = {
    "gemma": ("gemma", dict(head_dim=16)),
    "gemma2": ("gemma2", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=0.1,
                              final_logit_softcapping=1.0, tie_word_embeddings=True)),
    "gemma3": ("gemma3_text", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24, num_hidden_layers=3,
                                   layer_types=[SLIDING, FULL, SLIDING], final_logit_softcapping=1.0,
                                   tie_word_embeddings=True,
                                   rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10.0},
                                                    FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e3}})),
    "phi3-mini": ("phi3", dict(sliding_window=8)),
    # Phi-4-mini's shape: a quarter of each head unrotated, longrope. The long prompt starts past the original
    # context (long factors), the short one stays within it (short factors): both in one decode step.
    "phi4-mini": ("phi3", dict(max_position_embeddings=64, original_max_position_embeddings=20,
                               rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
                                                "short_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0],
                                                "long_factor": [2.0, 4.0, 8.0, 16.0, 24.0, 32.0],
                                                "original_max_position_embeddings": 20})),
}
PROMPT_LENGTHS = (24, 4)
MAX_TOKENS = 16


def make_checkpoint(family: str, tokenizer, folder: Path, families: dict = FAMILIES):
    """(transformers model, the folder it was saved in with the tokenizer) with random weights."""
    from transformers import AutoModelForCausalLM

    model_type, overrides = families[family]
    config = tiny_config(model_type, vocab_size=len(tokenizer), initializer_range=0.15, **overrides)
    if config.pad_token_id is not None and config.pad_token_id >= config.vocab_size:  # Phi-3's 32000, past a cut one
        config.pad_token_id = 0
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms start at their identity: perturb them so the (1 + weight) convention shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, folder


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def assert_answers_as_transformers(engine: Engine, hf_model) -> None:
    """Batched greedy tokens equal transformers' one prompt at a time; each token's logprob within 1e-3."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    batch = prompts()
    for prompt, completion in zip(batch, engine.generate(batch, params)):
        reference = hf_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                      eos_token_id=None, pad_token_id=0, output_logits=True,
                                      return_dict_in_generate=True)
        choice = completion.choices[0]
        assert choice.token_ids == reference.sequences[0, len(prompt):].tolist()
        for entry, logits in zip(choice.logprobs, reference.logits):
            expected = torch.log_softmax(logits[0].float(), dim=-1)[entry.token_id].item()
            assert abs(entry.logprob - expected) < 1e-3


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_folder_of_each_family_answers_as_transformers_natively(family, default_tokenizer, tmp_path, caplog):
    hf_model, folder = make_checkpoint(family, default_tokenizer, tmp_path / family)
    with caplog.at_level(logging.WARNING):
        engine = Engine(EngineConfig(model=str(folder), dtype="float32", cache_dir=str(tmp_path / "cache"))).start()
    try:
        assert engine.loaded.is_native
        assert not [r for r in caplog.records if "recomputes" in r.getMessage()]
        assert engine.max_model_len > 8  # not held inside the sliding window: the layers apply it
        assert_answers_as_transformers(engine, hf_model)
    finally:
        engine.stop()


def test_a_compiled_decode_step_answers_as_transformers_too(default_tokenizer, tmp_path):
    """The server compiles decode steps by default (--compile): Gemma 2's windowed and soft-capped layers compile
    and still give transformers' answers."""
    hf_model, folder = make_checkpoint("gemma2", default_tokenizer, tmp_path / "gemma2")
    engine = Engine(EngineConfig(model=str(folder), dtype="float32", compile=True,
                                 cache_dir=str(tmp_path / "cache"))).start()
    try:
        assert engine.runner.wait_for_compiled_decode(timeout_s=600) and engine.runner.decode_step == "compiled"
        assert_answers_as_transformers(engine, hf_model)
    finally:
        engine.stop()


def test_a_family_without_a_native_model_says_it_recomputes_every_step(default_tokenizer, tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "gpt2"
    AutoModelForCausalLM.from_config(tiny_config("gpt2")).save_pretrained(folder)
    default_tokenizer.save_pretrained(folder)
    with caplog.at_level(logging.WARNING):
        engine = Engine(EngineConfig(model=str(folder), dtype="float32", cache_dir=str(tmp_path / "cache")))
    assert not engine.loaded.is_native
    assert any("'gpt2' has no native implementation" in r.getMessage() and "slow" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)


def test_int8_weights_keep_a_familys_logits_close_to_float(default_tokenizer, tmp_path):
    """Gemma 2 under --quantization int8 (its linear layers quantized tensor by tensor as the folder loads):
    the first answer token's distribution stays close to the float model's."""
    hf_model, folder = make_checkpoint("gemma2", default_tokenizer, tmp_path / "gemma2")
    engine = Engine(EngineConfig(model=str(folder), quantization="int8", dtype="float32",
                                 cache_dir=str(tmp_path / "cache"))).start()
    try:
        assert engine.loaded.quantization == "int8"
        prompt = prompts()[0]
        [completion] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5))
        entry = completion.choices[0].logprobs[0]
        with torch.inference_mode():
            reference = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
        assert entry.token_id == int(reference.argmax())
        for token_id, logprob in entry.top:
            assert abs(logprob - reference[token_id].item()) < 0.05
    finally:
        engine.stop()


# --- GGUF files, written as llama.cpp's converter writes each family ------------------------------------------------

GGUF_ARCHITECTURES = {"gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}


def write_gguf(hf_model, path: Path) -> Path:
    """The model's float32 tensors under gguf-py's names, Gemma's norms stored as 1 + weight (llama.cpp's kernels
    multiply by the weight), and the metadata llama.cpp's converter writes for the family (convert_hf_to_gguf.py:
    Gemma2Model, Gemma3Model, Phi3MiniModel), longrope factors as the tensors rope_factors_long/short."""
    config = hf_model.config
    architecture = GGUF_ARCHITECTURES[config.model_type]
    writer = gguf.GGUFWriter(path, architecture)
    tokenizer_fields(writer, config.vocab_size)  # the model's own vocabulary
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters.get(FULL, config.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if architecture == "phi3":
        head_dim = config.hidden_size // config.num_attention_heads
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_sliding_window(config.sliding_window or 0)
    else:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_sliding_window(config.sliding_window)
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        if architecture == "gemma2":
            writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        elif rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == architecture)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    state_dict = hf_model.state_dict()
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    for name, tensor in state_dict.items():
        values = tensor.float().numpy()
        if architecture.startswith("gemma") and name.endswith("norm.weight"):
            values = values + 1
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), np.ascontiguousarray(values))
    if rope.get("rope_type") == "longrope":
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Shapes whose every setting a GGUF carries: Gemma 3 with the converter's layout (five sliding layers to one global,
# local RoPE base 10,000, query_pre_attn_scalar = head_dim) and linearly scaled global RoPE, as Gemma 3 4B has.
GGUF_FAMILIES = {
    "gemma2": ("gemma2", dict(FAMILIES["gemma2"][1], query_pre_attn_scalar=16)),
    "gemma3": ("gemma3_text", dict(head_dim=16, sliding_window=8, num_hidden_layers=6, query_pre_attn_scalar=16,
                                   final_logit_softcapping=1.0, tie_word_embeddings=True,
                                   rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 1e4},
                                                    FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e3}})),
    "phi3-mini": FAMILIES["phi3-mini"],
    "phi4-mini": FAMILIES["phi4-mini"],
}


@pytest.mark.parametrize("family", sorted(GGUF_FAMILIES))
def test_a_gguf_of_each_family_answers_as_the_checkpoint_it_was_converted_from(family, tiny_vocab_tokenizer, tmp_path):
    """Tensor names, Gemma's norm convention and every setting come from the file (transformers' own GGUF reader
    drops soft-caps, windows, rotary dimensions and RoPE scaling: engine/weights/gguf_config.py reads them): Tern's answers
    from the GGUF equal transformers' on the original checkpoint."""
    hf_model, _ = make_checkpoint(family, tiny_vocab_tokenizer, tmp_path / "folder", GGUF_FAMILIES)
    path = write_gguf(hf_model, tmp_path / f"{family}.gguf")
    engine = Engine(EngineConfig(model=str(path), quantization="none", dtype="float32",
                                 cache_dir=str(tmp_path / "cache"))).start()
    try:
        assert engine.loaded.is_native
        assert_answers_as_transformers(engine, hf_model)
    finally:
        engine.stop()


@pytest.mark.slow  # neither depends on the kernel path
@pytest.mark.parametrize("family", sorted(GGUF_FAMILIES))
def test_a_ggufs_config_reads_back_with_every_field_of_its_family(family, tiny_vocab_tokenizer, tmp_path):
    hf_model, _ = make_checkpoint(family, tiny_vocab_tokenizer, tmp_path / "folder", GGUF_FAMILIES)
    assert_config_reads_back(write_gguf(hf_model, tmp_path / f"{family}.gguf"), tmp_path / "cache")


@pytest.mark.slow  # neither depends on the kernel path
@pytest.mark.parametrize("family", sorted(GGUF_FAMILIES))
def test_a_ggufs_tokenizer_is_the_one_autotokenizer_builds(family, default_tokenizer, tmp_path):
    # The whole vocabulary: Gemma's tokenizer class reads it SentencePiece-style, with no unknown token to fall
    # back on, and the first 1,024 tokens do not cover the test's text.
    hf_model, _ = make_checkpoint(family, default_tokenizer, tmp_path / "folder", GGUF_FAMILIES)
    assert_tokenizer_as_autotokenizer(write_gguf(hf_model, tmp_path / f"{family}.gguf"), tmp_path / "cache")


@pytest.mark.slow  # neither depends on the kernel path
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_a_gemma_gguf_starts_without_transformers_modeling_code(family, tiny_vocab_tokenizer, tmp_path):
    """Its RoPE tables too are computed without transformers' Gemma modules. (torch._dynamo is imported all the same:
    Gemma's decode step is compiled, not the native one.)"""
    hf_model, _ = make_checkpoint(family, tiny_vocab_tokenizer, tmp_path / "folder", GGUF_FAMILIES)
    heavy = heavy_imports_of_a_start(write_gguf(hf_model, tmp_path / f"{family}.gguf"), tmp_path / "cache")
    assert "transformers.activations" not in heavy
