"""What llama.cpp's converter writes into a GGUF that transformers' GGUF reader leaves out, put back into the config
and the tokenizer (checkpoint.gguf_metadata writes them once), so that the native model computes what the original
checkpoint computed, on the tokens it was trained on, rather than transformers' defaults.

Tokenizer: transformers 5 sets the pre-tokenizer (how text is split before the merges) only for the
`tokenizer.ggml.pre` types in its own table; every other byte-level file gets GPT-2's split. SmolLM's files (the
default model) say "smollm": its tokenizer.json puts each digit on its own before GPT-2's split, so without this
"1)\n\n    0" became "\n\n   " + " " + "0" where llama.cpp and the original tokenizer give "\n\n    " + "0".

transformers 5 reads none of: Phi-3's rotary dimensions (Phi-4-mini rotates 3/4 of each head), its sliding window,
its original context and longrope factors (stored as the tensors rope_factors_long/short); Gemma 2's soft-caps; Gemma
3's final soft-cap and linear RoPE scaling of the global layers (Gemma 3 4B and up). Gemma's query_pre_attn_scalar is
in no GGUF: llama.cpp derives it (hidden_size / heads for the 27B models, head_dim otherwise), and so does this.
"""
from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# Layer counts of Gemma 2 27B and Gemma 3 27B, the models llama.cpp scales by hidden_size / heads (llama-model.cpp).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}


# `tokenizer.ggml.pre` types whose split llama.cpp (llama-vocab.cpp) makes as SmolLM's tokenizer.json does: each
# digit alone, then GPT-2's regex. transformers knows none of them.
_DIGITS_THEN_GPT2_SPLIT = ("smollm", "codeshell", "exaone", "minerva", "mellum2")


def complete_config(hf_config, tokenizer, gguf_path: Path) -> None:
    """Fill in hf_config and tokenizer (built by transformers from the same file, not saved yet) from the file's
    metadata."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    _complete_tokenizer(tokenizer, reader)
    architecture = _scalar(reader, "general.architecture")

    def field(key: str):
        return _scalar(reader, key.format(arch=architecture))

    model_type = hf_config.model_type
    if model_type == "phi3":
        _complete_phi3(hf_config, reader, field)
    elif model_type in _GEMMA_27B_LAYERS:
        _complete_gemma(hf_config, field)


def complete_tokenizer(tokenizer, gguf_path: Path) -> None:
    """The tokenizer part of complete_config, for a tokenizer saved without a config of Tern's."""
    import gguf

    _complete_tokenizer(tokenizer, gguf.GGUFReader(gguf_path))


def _complete_tokenizer(tokenizer, reader) -> None:
    pre = _scalar(reader, "tokenizer.ggml.pre")
    if pre in _DIGITS_THEN_GPT2_SPLIT:
        from tokenizers import pre_tokenizers

        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])


def _complete_phi3(hf_config, reader, field) -> None:
    import gguf

    keys = gguf.Keys
    rope = hf_config.rope_parameters
    head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    rotary_dims = field(keys.Rope.DIMENSION_COUNT)
    if rotary_dims and rotary_dims < head_dim:
        rope["partial_rotary_factor"] = rotary_dims / head_dim
    window = field(keys.Attention.SLIDING_WINDOW)
    hf_config.sliding_window = window or None  # the converter writes 0 for "none" (Phi-4)
    original = field(keys.Rope.SCALING_ORIG_CTX_LEN)
    if original:
        hf_config.original_max_position_embeddings = original
    factors = {t.name: t.data.astype(float).tolist() for t in reader.tensors
               if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
    if len(factors) == 2 and original:
        rope.update(rope_type="longrope", long_factor=factors["rope_factors_long.weight"],
                    short_factor=factors["rope_factors_short.weight"], original_max_position_embeddings=original)


def _complete_gemma(hf_config, field) -> None:
    import gguf

    keys = gguf.Keys
    final_softcap = field(keys.LLM.FINAL_LOGIT_SOFTCAPPING)
    if final_softcap:
        hf_config.final_logit_softcapping = final_softcap
    if hf_config.model_type == "gemma2":
        attn_softcap = field(keys.LLM.ATTN_LOGIT_SOFTCAPPING)
        if attn_softcap:
            hf_config.attn_logit_softcapping = attn_softcap
    elif field(keys.Rope.SCALING_TYPE) == "linear":
        hf_config.rope_parameters["full_attention"].update(rope_type="linear", factor=field(keys.Rope.SCALING_FACTOR))
    is_27b = hf_config.num_hidden_layers == _GEMMA_27B_LAYERS[hf_config.model_type]
    hf_config.query_pre_attn_scalar = (hf_config.hidden_size // hf_config.num_attention_heads if is_27b
                                       else hf_config.head_dim)


def _scalar(reader, key: str):
    """A string or number field's value, or None when the file has no such field."""
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(value).decode("utf-8", errors="replace")
    return value[0].item()
