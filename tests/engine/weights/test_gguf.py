"""GGUF files served from their own blocks: each 4-bit type repacks to the file's values, a file of every supported
mix loads tensor by tensor into the layers that serve it and answers as transformers does on the same file, and a
cut, foreign or unsupported file is one clear error before any weight is read.

The files are written here with `gguf`'s writer: tiny Llama shapes (K-quants need rows of 256), the default model's
tokenizer, random weights (K-quant blocks as random bytes with small scales: gguf-py has no K-quant quantizer).
"""
from __future__ import annotations

import json

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter, quants

from conftest import (assert_config_reads_back, assert_tokenizer_as_autotokenizer, cpu_kernels, heavy_imports_of_a_start,
                      require_op, tokenizer_fields)

from engine import Engine, EngineConfig, ModelLoadError, SamplingParams
from engine.weights import gguf_blocks
from engine.weights.gguf_blocks import GGUF_TYPES
from engine.kernels import GGUF_REPACK_LAYOUTS, layouts
from engine.weights.layers import (Int4Embedding, Int4Linear, Q4Embedding, Q4KEmbedding, Q4KLinear, Q4Linear,
                                   Q5KEmbedding, Q5KLinear, Q6KEmbedding, Q6KLinear, Q8Embedding, Q8Linear,
                                   SplitLinear)
from engine.weights.checkpoint import default_gguf_path

BLOCK = {T.Q4_0: (32, 18), T.Q4_1: (32, 20), T.Q4_K: (256, 144), T.Q5_0: (32, 22), T.Q5_K: (256, 176),
         T.Q6_K: (256, 210), T.Q8_0: (32, 34)}
SCALE_BYTES = {T.Q4_0: (0, 2), T.Q4_1: (0, 4), T.Q4_K: (0, 4), T.Q5_0: (0, 2), T.Q5_K: (0, 4), T.Q6_K: (208, 210),
               T.Q8_0: (0, 2)}


def random_blocks(ggml_type: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, bytes per row]: random quants, and fp16 scales (and minimums) small enough to make weights of
    a few hundredths, as a real layer's are."""
    rng = np.random.default_rng(seed)
    values, size = BLOCK[ggml_type]
    raw = rng.integers(0, 256, size=(rows, cols // values, size), dtype=np.uint8)
    start, end = SCALE_BYTES[ggml_type]
    scales = (rng.uniform(0.5, 1.5, size=(rows, cols // values, (end - start) // 2)) * 2e-3).astype(np.float16)
    raw[..., start:end] = scales.view(np.uint8).reshape(rows, cols // values, end - start)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_1])
def test_q4_0_and_q4_1_repack_into_int4_bit_for_bit(ggml_type):
    raw = torch.from_numpy(random_blocks(ggml_type, 24, 512))
    packed = GGUF_TYPES[ggml_type].repack_into("int4")(raw)
    assert torch.equal(layouts.dequantize_int4(packed), torch.from_numpy(quants.dequantize(raw.numpy(), ggml_type)))


@pytest.mark.parametrize("ggml_type", [T.Q5_0, T.Q4_0], ids=lambda t: t.name)
def test_q5_0_and_q4_0_go_into_q8_bit_for_bit(ggml_type):
    """Their levels (q - 16, q - 8) are int8 levels under the file's own scale: Q5_0 is served in q8 as it is, and
    Q4_0 goes there beside a fused layer's q8 parts, neither re-quantized."""
    raw = torch.from_numpy(random_blocks(ggml_type, 24, 512))
    packed = GGUF_TYPES[ggml_type].repack_into("q8")(raw)
    assert torch.equal(layouts.dequantize_q8(packed), torch.from_numpy(quants.dequantize(raw.numpy(), ggml_type)))


def test_q4_0_is_served_in_q4_its_own_bytes_bit_for_bit():
    raw = torch.from_numpy(random_blocks(T.Q4_0, 24, 512))
    assert GGUF_TYPES[T.Q4_0].layout == "q4"
    packed = GGUF_TYPES[T.Q4_0].repack(raw)
    assert packed.numel() == raw.numel()  # 18 bytes per 32 values, as in the file
    assert torch.equal(layouts.dequantize_q4(packed), torch.from_numpy(quants.dequantize(raw.numpy(), T.Q4_0)))


def test_q8_0_repacks_into_q8_bit_for_bit():
    raw = torch.from_numpy(random_blocks(T.Q8_0, 24, 512))  # every int8 value, -128 included
    packed = GGUF_TYPES[T.Q8_0].repack(raw)
    assert torch.equal(layouts.dequantize_q8(packed), torch.from_numpy(quants.dequantize(raw.numpy(), T.Q8_0)))


def test_q4_k_is_served_in_q4k_its_own_bytes_bit_for_bit():
    """Q4_K's per-sub-block scale (super-block d x 6-bit scale) and minimum are fp32 products in the file, and q4k
    keeps the factors: the values are gguf's, bit for bit, in the file's 144 bytes per 256 values."""
    raw = torch.from_numpy(random_blocks(T.Q4_K, 24, 512))
    assert GGUF_TYPES[T.Q4_K].layout == "q4k"
    packed = GGUF_TYPES[T.Q4_K].repack(raw)
    assert packed.numel() == raw.numel()
    assert torch.equal(layouts.dequantize_q4k(packed), torch.from_numpy(quants.dequantize(raw.numpy(), T.Q4_K)))


def test_q6_k_is_served_in_q6k_its_own_bytes_bit_for_bit():
    """Q6_K's values are (d * scale) * (q - 32) with an int8 scale per 16 values: q6k keeps q, the scales and d as
    the file has them, in its 210 bytes per 256 values, and gives gguf's values bit for bit."""
    raw = torch.from_numpy(random_blocks(T.Q6_K, 24, 512))
    assert GGUF_TYPES[T.Q6_K].layout == "q6k"
    packed = GGUF_TYPES[T.Q6_K].repack(raw)
    assert packed.numel() == raw.numel()
    assert torch.equal(layouts.dequantize_q6k(packed), torch.from_numpy(quants.dequantize(raw.numpy(), T.Q6_K)))


def test_q5_k_is_served_in_q5k_its_own_bytes_bit_for_bit():
    """Q5_K is Q4_K with a fifth bit per value (its own 32 bytes per super-block, value l of sub-block j at bit j
    of byte l): q5k keeps q, the scales, minimums, d and dmin as the file has them, in its 176 bytes per 256 values,
    and gives gguf's values bit for bit."""
    raw = torch.from_numpy(random_blocks(T.Q5_K, 24, 512))
    assert GGUF_TYPES[T.Q5_K].layout == "q5k"
    packed = GGUF_TYPES[T.Q5_K].repack(raw)
    assert packed.numel() == raw.numel()
    assert torch.equal(layouts.dequantize_q5k(packed), torch.from_numpy(quants.dequantize(raw.numpy(), T.Q5_K)))
    assert torch.equal(packed, layouts.pack_q5k(*gguf_blocks.q5_k_to_q5k(raw)))


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_1, T.Q4_K])
def test_the_fast_int4_repacking_gives_the_bytes_of_its_plain_twin(ggml_type):
    """The int4 repacking works on 32-bit words of nibbles; its twin decodes one value per byte and packs them
    with layouts.pack_int4, the function the kernels' layout is defined by. (Q4_0 is served in q4 and Q4_K in q4k,
    and go into int4 beside other 4-bit parts of a fused layer.)"""
    raw = torch.from_numpy(random_blocks(ggml_type, 40, 1024, seed=3))
    kind = GGUF_TYPES[ggml_type]
    plain = {T.Q4_0: gguf_blocks.q4_0_to_int4, T.Q4_1: gguf_blocks.q4_1_to_int4, T.Q4_K: gguf_blocks.q4_k_to_int4}
    assert torch.equal(kind.repack_into("int4")(raw), layouts.pack_int4(*plain[ggml_type](raw)))
    if ggml_type == T.Q4_0:  # m = -8 d, the same weight as its q4
        assert torch.equal(kind.repack_into("int4")(raw), layouts.q4_as_int4(kind.repack(raw)))


def test_q4_k_repacks_into_int4_within_the_rounding_of_its_scales_to_fp16():
    """Beside Q4_0 or Q4_1 parts of a fused layer Q4_K goes into int4, which stores its fp32 scale and minimum
    products in fp16. Its values are the file's quants times those products rounded to fp16, exactly."""
    raw = random_blocks(T.Q4_K, 24, 512)
    ours = layouts.dequantize_int4(GGUF_TYPES[T.Q4_K].repack_into("int4")(torch.from_numpy(raw)))
    reference = torch.from_numpy(quants.dequantize(raw, T.Q4_K))
    # Per block of 32 the file's w = s * q - m; with s and m rounded to fp16 the error is at most q * |ds| + |dm|.
    blocks = raw.reshape(24, 2, 144)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16).astype(np.float32)).squeeze(-1)
    dmin = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16).astype(np.float32)).squeeze(-1)
    bound = (15 * 63 * d + 63 * dmin).repeat_interleave(256, dim=1) * 2.0**-11
    assert (ours - reference).abs().le(bound).all()
    assert not torch.equal(ours, reference)  # the rounding is real: say so rather than claim bits


HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2


def write_tiny_gguf(path: Path, types: dict[str, T], tied: bool = True, seed: int = 0) -> Path:
    """A tiny Llama GGUF; `types` maps tensor roles (embd, q, k, v, o, gate, up, down, output) to ggml types."""
    writer = GGUFWriter(path, "llama")
    vocab = tokenizer_fields(writer)
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS

    def matrix(name: str, role: str, rows: int, cols: int) -> None:
        ggml_type = types.get(role, T.F32)
        if ggml_type == T.F32:
            writer.add_tensor(name, (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32))
        elif ggml_type in (T.Q4_K, T.Q5_K, T.Q6_K):
            writer.add_tensor(name, random_blocks(ggml_type, rows, cols, seed=rng.integers(1 << 30)),
                              raw_dtype=ggml_type)
        else:
            weights = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
            writer.add_tensor(name, quants.quantize(weights, ggml_type), raw_dtype=ggml_type)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))

    matrix("token_embd.weight", "embd", vocab, HIDDEN)
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", "q", HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_k.weight", "k", KV_HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_v.weight", "v", KV_HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_output.weight", "o", HIDDEN, HIDDEN)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", "gate", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_up.weight", "up", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_down.weight", "down", HIDDEN, FFN)
    norm("output_norm.weight")
    if not tied:
        matrix("output.weight", "output", vocab, HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def blocks_of(ggml_type: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, bytes per row] of any type the loader reads: random_blocks for those it knows, gguf's own
    quantizer over random weights for Q5_1/F16/BF16/F32."""
    if ggml_type in BLOCK:
        return random_blocks(ggml_type, rows, cols, seed)
    rng = np.random.default_rng(seed)
    weights = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
    return quants.quantize(weights, ggml_type).reshape(rows, -1).view(np.uint8)


REPACKED_TYPES = [T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.Q8_0, T.F16, T.BF16, T.F32]


@pytest.mark.parametrize("ggml_type", REPACKED_TYPES, ids=lambda t: t.name)
def test_the_kernel_librarys_repacking_gives_its_plain_twins_bytes(ggml_type, path_kernels):
    """At load time the kernel library repacks a GGUF matrix in one pass (CpuKernels.gguf_repack); its twins are
    gguf_blocks' torch repacking (int4) and gguf's de-quantizer followed by quant.quantize_q8 (q8) or, for float
    types, quant.quantize_int4 (int4): the same bytes,
    so the file's values (or their q8 rounding) do not depend on whether a kernel path was built."""
    from engine.weights import quant

    repack = require_op(path_kernels.gguf_repack, "GGUF repacking")
    rows, cols = 40, 1024
    raw = torch.from_numpy(blocks_of(ggml_type, rows, cols, seed=5).copy())
    kind = GGUF_TYPES[ggml_type]
    if kind.layout in ("int4", "q4", "q4k", "q5k", "q6k"):
        assert torch.equal(repack(raw, int(ggml_type), cols, GGUF_REPACK_LAYOUTS[kind.layout]), kind.repack(raw))
    if kind.layout in ("q4", "q4k"):  # Q4_0 and Q4_K also into int4, beside int4 parts of a fused layer
        assert torch.equal(repack(raw, int(ggml_type), cols, GGUF_REPACK_LAYOUTS["int4"]), kind.repack_into("int4")(raw))
    if kind.holds("q8"):  # Q8_0 its own blocks, Q5_0 and Q4_0 their levels
        assert torch.equal(repack(raw, int(ggml_type), cols, GGUF_REPACK_LAYOUTS["q8"]), kind.repack_into("q8")(raw))
    else:  # into q8 (a fused layer with a part that is not 4-bit takes q8 whole)
        floats = torch.from_numpy(quants.dequantize(raw.numpy(), ggml_type).astype(np.float32)).reshape(rows, cols)
        assert torch.equal(repack(raw, int(ggml_type), cols, GGUF_REPACK_LAYOUTS["q8"]), quant.pack_q8(floats))
    if ggml_type in (T.F16, T.BF16, T.F32):  # --quantization int4 of a float file (or a folder's rows) in one pass
        floats = torch.from_numpy(quants.dequantize(raw.numpy(), ggml_type).astype(np.float32)).reshape(rows, cols)
        assert torch.equal(repack(raw, int(ggml_type), cols, GGUF_REPACK_LAYOUTS["int4"]), quant.pack_int4(floats))


def every(ggml_type: T, **others: T) -> dict[str, T]:
    roles = ("embd", "q", "k", "v", "o", "gate", "up", "down", "output")
    return {**{role: ggml_type for role in roles}, **others}


# Like llama.cpp's Q4_K_M: 4-bit K-quants, with v, down and the output head in Q6_K.
Q4_K_M = every(T.Q4_K, v=T.Q6_K, down=T.Q6_K, output=T.Q6_K)
Q5_K_M = every(T.Q5_K, v=T.Q6_K, down=T.Q6_K, output=T.Q6_K)  # the same with 5-bit K-quants
FILES = {
    "Q4_0": (every(T.Q4_0), True),
    "Q4_0 with Q4_1 v and up": (every(T.Q4_0, v=T.Q4_1, up=T.Q4_1), False),
    "Q8_0": (every(T.Q8_0), True),
    "Q6_K": (every(T.Q6_K), True),
    "Q5_0 with Q4_0 q and gate": (every(T.Q5_0, q=T.Q4_0, gate=T.Q4_0), True),
    "Q4_1+Q8_0 embedding": (every(T.Q4_1, embd=T.Q8_0), True),
    "Q4_K_M-like, untied": (Q4_K_M, False),
    "Q5_K_M-like, untied": (Q5_K_M, False),
    "Q4_K with Q4_1 k and Q4_0 up": (every(T.Q4_K, k=T.Q4_1, up=T.Q4_0), True),
    "F32": (every(T.F32), False),
}


@pytest.fixture(scope="module", params=sorted(FILES))
def tiny_gguf(request, tmp_path_factory) -> Path:
    types, tied = FILES[request.param]
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", types, tied)


def transformers_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.slow  # the config does not depend on the kernel path: not run again with TERN_CPU_KERNELS=off
def test_a_llama_ggufs_config_reads_back_with_every_field(tmp_path):
    assert_config_reads_back(write_tiny_gguf(tmp_path / "tiny.gguf", *FILES["Q4_1+Q8_0 embedding"]), tmp_path)


@pytest.mark.slow  # nor does the tokenizer
def test_a_llama_ggufs_tokenizer_is_the_one_autotokenizer_builds(tmp_path):
    assert_tokenizer_as_autotokenizer(write_tiny_gguf(tmp_path / "tiny.gguf", *FILES["Q4_1+Q8_0 embedding"]), tmp_path)


@pytest.mark.slow
def test_a_config_written_by_another_transformers_goes_through_its_familys_class(tmp_path):
    """Its fields were complete for the version that wrote them, not necessarily for this one."""
    from transformers import LlamaConfig

    from engine.weights.checkpoint import gguf_metadata, read_config

    folder = gguf_metadata(write_tiny_gguf(tmp_path / "tiny.gguf", *FILES["Q4_1+Q8_0 embedding"]), tmp_path)
    fields = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(fields, transformers_version="4.0.0")))
    assert type(read_config(folder, tmp_path)) is LlamaConfig


@pytest.mark.slow
def test_a_native_gguf_loads_without_transformers_modeling_stack(tmp_path):
    """Where the native C++ step serves (a kernel path), torch._dynamo is not imported either; without one the
    compiled step serves and needs it."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", *FILES["Q4_1+Q8_0 embedding"])
    heavy = heavy_imports_of_a_start(path, tmp_path / "cache")
    assert "transformers.activations" not in heavy
    if cpu_kernels().path != "off":
        assert heavy == []


@pytest.mark.slow  # the layers as built, before any kernel path packs them: not run again with TERN_CPU_KERNELS=off
def test_a_gguf_loads_from_its_blocks_with_the_files_values(tiny_gguf, tmp_path):
    """4-bit tensors are built 4-bit and Q8_0 and Q5_0 ones q8, with the values transformers de-quantizes from the
    file (exact for Q4_0/Q4_1/Q4_K/Q5_0/Q8_0, and for Q4_0 parts joined to q8 ones; within fp16 rounding of the
    scales for Q4_K parts joined to other 4-bit types in int4); Q5_K in q5k and Q6_K in q6k, exact; a fused projection
    whose parts the file holds in different layouts (a Q4_K_M file's q, k and v) keeps each part's, exactly; the rest (F32) q8
    within half a step of its scales; q and k rows in transformers' order. (The layers as built, before packing for a kernel
    path: without kernels aten's int4pack re-packs them in its own way.)"""
    from transformers import AutoConfig

    from engine.weights.gguf_file import GgufFile
    from engine.weights.checkpoint import gguf_metadata
    from engine.weights.streamed_load import build_model

    hf_config = AutoConfig.from_pretrained(gguf_metadata(tiny_gguf, tmp_path))
    model = build_model(GgufFile.open(tiny_gguf), hf_config, "auto", torch.float32, torch.device("cpu"), q4k=True,
                        q5k=True, q6k=True)
    reference = transformers_model(tiny_gguf).state_dict()
    reader = GGUFReader(tiny_gguf)
    types = {t.name: t.tensor_type for t in reader.tensors}
    for index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{index}."
        for fused, parts, gguf_names in (
            (layer.self_attn.qkv_proj, ["q_proj", "k_proj", "v_proj"], ["attn_q", "attn_k", "attn_v"]),
            (layer.mlp.gate_up_proj, ["gate_proj", "up_proj"], ["ffn_gate", "ffn_up"]),
        ):
            kinds = {types[f"blk.{index}.{g}.weight"] for g in gguf_names}
            is_4bit = kinds <= {T.Q4_0, T.Q4_1, T.Q4_K}
            section = "self_attn." if "q_proj" in parts else "mlp."
            expected = torch.cat([reference[prefix + section + p + ".weight"] for p in parts])
            layouts_held = {GGUF_TYPES[kind].layout for kind in kinds}
            if not is_4bit and len(layouts_held) > 1 and "dequantize" not in layouts_held:
                # Parts of different layouts keep each its own, side by side: the file's values, exactly.
                assert type(fused) is SplitLinear and len(fused.parts) > 1
                dequantize = {Q4Linear: layouts.dequantize_q4, Q4KLinear: layouts.dequantize_q4k,
                              Q5KLinear: layouts.dequantize_q5k, Q6KLinear: layouts.dequantize_q6k,
                              Q8Linear: layouts.dequantize_q8}
                ours = torch.cat([dequantize[type(part)](part.weight_packed) for part in fused.parts])
                assert torch.equal(ours, expected)
                continue
            # Q4_0 alone in its own q4 layout, Q4_K in q4k; beside other 4-bit parts, int4; else q8.
            expected_type = (Q4Linear if kinds == {T.Q4_0} else Q4KLinear if kinds == {T.Q4_K} else
                             Q5KLinear if kinds == {T.Q5_K} else Q6KLinear if kinds == {T.Q6_K} else
                             Int4Linear if is_4bit else Q8Linear)
            assert type(fused) is expected_type, (kinds, type(fused))
            if expected_type in (Q5KLinear, Q6KLinear):
                assert torch.equal(expected_type.dequantize(fused.weight_packed), expected)
            elif not is_4bit:
                ours = layouts.dequantize_q8(fused.weight_packed)
                if all(GGUF_TYPES[kind].holds("q8") for kind in kinds):  # Q8_0, Q5_0, and Q4_0 beside them
                    assert torch.equal(ours, expected)
                else:  # re-quantized per 32 values: within half a step (absmax / 127, rounded to fp16) of each
                    step = expected.reshape(expected.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127
                    error = (ours - expected).reshape(step.shape[0], -1, 32).abs()
                    assert (error <= 0.5 * step * (1 + 2.0**-10) + 1e-12).all()
            else:
                dequantize = {Q4Linear: layouts.dequantize_q4, Q4KLinear: layouts.dequantize_q4k,
                              Int4Linear: layouts.dequantize_int4}[expected_type]
                ours = dequantize(fused.weight_packed)
                if T.Q4_K in kinds and expected_type is Int4Linear:
                    # w = s * q - m with s and m rounded to fp16 (relative 2^-11 each): s * q and m are at
                    # most the largest |w| or so, whence the bound; near-cancelling w have no relative bound.
                    assert (ours - expected).abs().max() <= 2.0**-9 * expected.abs().max()
                    assert not torch.equal(ours, expected)
                else:
                    assert torch.equal(ours, expected)
    embd_type = types["token_embd.weight"]
    is_4bit = embd_type in (T.Q4_0, T.Q4_1, T.Q4_K)
    embeddings = {T.Q4_0: Q4Embedding, T.Q4_K: Q4KEmbedding, T.Q5_K: Q5KEmbedding, T.Q6_K: Q6KEmbedding}
    assert type(model.model.embed_tokens) is embeddings.get(embd_type, Int4Embedding if is_4bit else Q8Embedding)
    ids = torch.tensor([0, 7, 777, len(reference["model.embed_tokens.weight"]) - 1])
    rows = model.model.embed_tokens(ids).float()
    if embd_type in (T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_0, T.Q5_K, T.Q6_K, T.Q8_0):  # the rest is re-quantized to q8
        assert torch.equal(rows, reference["model.embed_tokens.weight"][ids])


ON_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                          reason="needs a CUDA device")])


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
def test_a_gguf_answers_as_transformers_does_on_the_same_file(tiny_gguf, tmp_path, device):
    """Greedy tokens with the file's values in float32 (quantization none) match transformers' on the same file:
    the config, the tokenizer, the names and the q/k row order all come from the file. On CUDA every type the file
    holds is de-quantized tensor by tensor onto the GPU."""
    engine = Engine(EngineConfig(model=str(tiny_gguf), quantization="none", dtype="float32", device=device,
                                 cache_dir=str(tmp_path))).start()
    try:
        assert engine.device.type == device
        hf = transformers_model(tiny_gguf).to(device)
        prompt = engine.loaded.tokenizer.encode("The capital of France is")
        [completion] = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        expected = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=12, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert completion.choices[0].token_ids == expected
    finally:
        engine.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_k_quant_gguf_serves_on_cuda_in_bf16_with_its_own_values(tmp_path):
    """`auto` on CUDA: the file's blocks de-quantized to bf16 on the GPU (the values gguf de-quantizes, rounded to
    bf16), and the engine answers with them."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", Q4_K_M, tied=False)
    engine = Engine(EngineConfig(model=str(path), cache_dir=str(tmp_path / "cache"))).start()
    try:
        assert engine.device.type == "cuda" and engine.loaded.dtype == torch.bfloat16
        assert engine.loaded.quantization == "none"
        reference = transformers_model(path).state_dict()
        ours = engine.loaded.model.state_dict()
        down = ours["model.layers.0.mlp.down_proj.weight"]
        assert down.device.type == "cuda" and down.dtype == torch.bfloat16
        assert torch.equal(down.cpu(), reference["model.layers.0.mlp.down_proj.weight"].to(torch.bfloat16))
        prompt = engine.loaded.tokenizer.encode("The capital of France is")
        [completion] = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert len(completion.choices[0].token_ids) == 8
    finally:
        engine.stop()


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M", "Q5_K_M"])
def test_a_quantized_gguf_takes_the_files_size_in_memory(tmp_path, name):
    mixes = {"Q4_K_M": Q4_K_M, "Q5_K_M": Q5_K_M}
    types = mixes.get(name) or every(T[name])
    path = write_tiny_gguf(tmp_path / "model.gguf", types, tied=name not in mixes)
    engine = Engine(EngineConfig(model=str(path), quantization="auto", cache_dir=str(tmp_path / "cache"))).start()
    try:
        assert engine.loaded.quantization == ("int8" if name in ("Q5_K", "Q6_K", "Q5_K_M") else "int4")
        # Q4_0 is served in its own 18 bytes per 32 values (q4), Q4_K in its 144 per 256 (q4k), Q5_K in its 176 per
        # 256 (q5k), Q6_K in its 210 per 256 (q6k), a Q4_K_M (Q5_K_M) file's qkv as its parts (q4k (q5k) and q6k
        # side by side), and the norms as the file's float32. Without Tern's kernels (TERN_CPU_KERNELS=off) aten's
        # int4pack holds its own copies of the 4-bit layers, and Q5_K and Q6_K go into q8.
        tensor_bytes = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
        kernels = engine.loaded.kernels
        needed = {"Q4_0": [kernels.q4_mm], "Q4_K": [kernels.q4k_mm], "Q5_K": [kernels.q5k_mm], "Q6_K": [kernels.q6k_mm],
                  "Q4_K_M": [kernels.q4k_mm, kernels.q6k_mm], "Q5_K_M": [kernels.q5k_mm, kernels.q6k_mm]}[name]
        if kernels.path != "off" and None not in needed:
            assert engine.loaded.weight_bytes == tensor_bytes
            # The log and the UI name what the weights are held in, not the mode `auto` resolved to.
            held = {"Q4_0": {"q4"}, "Q4_K": {"q4k"}, "Q5_K": {"q5k"}, "Q6_K": {"q6k"}, "Q4_K_M": {"q4k", "q6k"},
                    "Q5_K_M": {"q5k", "q6k"}}[name]
            kind, _ = engine.info().weights.split(": ", 1)
            assert kind.startswith("weights in ") and set(kind.removeprefix("weights in ").split(", ")) == held
        [completion] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert len(completion.choices[0].token_ids) == 4
    finally:
        engine.stop()
    # Only the config and tokenizer were written to the cache, never a de-quantized copy.
    cached = [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and "kernels" not in p.parts]
    assert cached and sum(p.stat().st_size for p in cached) < 0.5 * path.stat().st_size


@pytest.mark.slow  # takes has_kernel as a parameter, not from the kernel path
@pytest.mark.parametrize("has_kernel", [True, False])
def test_the_load_says_what_serves_q5_k(tmp_path, caplog, has_kernel):
    """The load's one summary line names each type and its layout: Q5_K as q5k where a kernel serves it, else as q8
    (re-quantized from gguf's values, as on the `off` path)."""
    import logging

    from transformers import AutoConfig

    from engine.weights.checkpoint import gguf_metadata
    from engine.weights.gguf_file import GgufFile
    from engine.weights.streamed_load import build_model

    path = write_tiny_gguf(tmp_path / "tiny.gguf", Q5_K_M, tied=False)
    hf_config = AutoConfig.from_pretrained(gguf_metadata(path, tmp_path))
    with caplog.at_level(logging.INFO, logger="engine.weights.streamed_load"):
        build_model(GgufFile.open(path), hf_config, "auto", torch.float32, torch.device("cpu"), q5k=has_kernel,
                    q6k=True)
    summary = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("tiny.gguf: "))
    assert ("Q5_K as q5k" in summary) == has_kernel and ("Q5_K as q8" in summary) != has_kernel, summary
    assert "Q6_K as q6k" in summary


def test_large_tensors_read_in_two_halves_give_the_files_bytes_with_q_and_k_rows_in_transformers_order(tmp_path):
    """Within a load (reading()), reads of 8 MiB and more go half on a helper thread and q and k rows are put back in
    order into memory kept for the next matrix: each matrix read is the file's bytes, its q and k rows in the order
    transformers' own GGUF loader gives them, however many reads went before (a big q, a small k, a big q again)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from engine.weights.gguf_file import GgufFile

    heads, kv_heads, head_dim, cols = 16, 4, 128, 1024  # q: 8 MiB of float32, read in halves; k: 2 MiB, read whole
    rng = np.random.default_rng(0)
    values = {"attn_q": rng.standard_normal((heads * head_dim, cols)).astype(np.float32),
              "attn_k": rng.standard_normal((kv_heads * head_dim, cols)).astype(np.float32),
              "ffn_down": rng.standard_normal((heads * head_dim, cols)).astype(np.float32)}
    path = tmp_path / "large.gguf"
    writer = GGUFWriter(path, "llama")
    for part, matrix in values.items():
        writer.add_tensor(f"blk.0.{part}.weight", matrix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    processor = LlamaTensorProcessor({"num_attention_heads": heads, "num_key_value_heads": kv_heads})
    expected = {part: processor.process(matrix, f"blk.0.{part}.weight").weights for part, matrix in values.items()}
    assert not np.array_equal(expected["attn_q"], values["attn_q"])  # the file's rows are in another order
    names = {"attn_q": ("model.layers.0.self_attn.q_proj.weight", heads),
             "attn_k": ("model.layers.0.self_attn.k_proj.weight", kv_heads),
             "ffn_down": ("model.layers.0.mlp.down_proj.weight", None)}
    source = GgufFile.open(path)
    with source.reading():
        for part in ("attn_q", "attn_k", "ffn_down", "attn_q"):
            name, num_heads = names[part]
            read = source.raw(name, num_heads, scratch=True).view(torch.float32).numpy()
            assert np.array_equal(read, expected[part]), part
    for part, (name, num_heads) in names.items():  # outside a load: memory of its own, one read
        assert np.array_equal(source.raw(name, num_heads).view(torch.float32).numpy(), expected[part]), part


def test_a_cut_gguf_is_one_clear_error_naming_the_file_and_leaves_no_cache(tmp_path):
    path = write_tiny_gguf(tmp_path / "whole.gguf", every(T.Q4_0))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*(truncated|not a readable GGUF)"):
        Engine(EngineConfig(model=str(cut), cache_dir=str(cache)))
    assert not [p for p in cache.rglob("*") if "kernels" not in p.parts and p.name != "kernels"]


def test_an_unsupported_tensor_type_names_the_tensor_and_the_type(tmp_path):
    """IQ2_XS has no layout in Tern: refused before any weight is read, naming the file, tensor and type."""
    path = tmp_path / "iq.gguf"
    writer = GGUFWriter(path, "llama")
    tokenizer_fields(writer)
    writer.add_block_count(1)
    _, block_bytes = GGML_QUANT_SIZES[T.IQ2_XS]
    writer.add_tensor("token_embd.weight", np.zeros((4, block_bytes), dtype=np.uint8), raw_dtype=T.IQ2_XS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"iq\.gguf: tensor token_embd\.weight is IQ2_XS"):
        Engine(EngineConfig(model=str(path), cache_dir=str(tmp_path / "cache")))


@pytest.mark.slow  # reads headers only: does not depend on the kernel path
@pytest.mark.parametrize("which", ["default model", "tiny"])
def test_terns_header_reader_reads_what_ggufs_own_reader_reads(which, tmp_path):
    """A new file's first start parses its header with HeaderReader (gguf's reader over a plain array: a large
    vocabulary's header in a third of the time): every field and tensor must be what gguf's reader finds."""
    from engine.weights.gguf_file import HeaderReader

    path = default_gguf_path() if which == "default model" else write_tiny_gguf(tmp_path / "t.gguf", every(T.Q4_K))
    ours, theirs = HeaderReader(path), GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.types, mine.data, mine.offset) == (field.types, field.data, field.offset), name
        assert [bytes(p) for p in mine.parts] == [bytes(p) for p in field.parts], name
    assert len(ours.tensors) == len(theirs.tensors) > 0
    for mine, tensor in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.tensor_type, list(mine.shape), mine.n_bytes, mine.data_offset) == (
            tensor.name, tensor.tensor_type, list(tensor.shape), tensor.n_bytes, tensor.data_offset)
        assert np.array_equal(mine.data, tensor.data), mine.name


def test_a_first_start_parses_a_gguf_header_once_and_puts_ggufs_reader_back(tmp_path):
    """Within reading_headers_once every reader of the file (Tern's index, transformers' config and tokenizer,
    gguf_config) gets one parse; after it, and after a failure inside it, gguf's own reader is back."""
    import gguf

    from engine.weights.gguf_file import reading_headers_once

    path = write_tiny_gguf(tmp_path / "t.gguf", every(T.Q4_0))
    with reading_headers_once():
        assert gguf.GGUFReader(path) is gguf.GGUFReader(str(path)) is not None
    assert gguf.GGUFReader is GGUFReader
    not_a_gguf = tmp_path / "text.gguf"
    not_a_gguf.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError), reading_headers_once():
        gguf.GGUFReader(not_a_gguf)
    assert gguf.GGUFReader is GGUFReader


@pytest.mark.slow  # reads metadata only: does not depend on the kernel path
def test_a_first_start_decodes_a_ggufs_metadata_once_for_transformers_config_and_tokenizer(tmp_path, monkeypatch):
    """transformers asks load_gguf_checkpoint for a file's metadata once for the config and again for the
    tokenizer: within reading_headers_once the second call gets the first's result, as its own copy (a caller that
    changes it changes nothing for the next), and after the block transformers' own function is back."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    from engine.weights.gguf_file import reading_headers_once

    path = write_tiny_gguf(tmp_path / "t.gguf", every(T.Q4_0))
    own = gguf_utils.load_gguf_checkpoint
    decoded = []
    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", lambda *a, **k: decoded.append(a) or own(*a, **k))
    counting = gguf_utils.load_gguf_checkpoint
    with reading_headers_once():
        first = gguf_utils.load_gguf_checkpoint(path, return_tensors=False)
        first["config"]["model_type"] = "changed by its caller"
        second = gguf_utils.load_gguf_checkpoint(str(path), return_tensors=False)
    assert len(decoded) == 1
    assert second["config"]["model_type"] == "llama"
    assert second["tokenizer"]["tokens"] == own(path, return_tensors=False)["tokenizer"]["tokens"]
    assert gguf_utils.load_gguf_checkpoint is counting
