"""What each kernel path means for an engine: its matrices are packed for the path's kernels (tied ones shared),
a sequence's tokens do not depend on what shares its steps, and the answers agree with the unpacked twin."""
from __future__ import annotations

import copy
import time

import pytest
import torch
from conftest import build_tiny, require_op, tiny_config, tiny_quantized_engine

from engine import Engine, EngineConfig, SamplingParams
from engine.weights import layers, quant, sizes

PACKED = {"int8": layers.PackedQ8Linear, "int4": layers.PackedInt4Linear}  # int8: per 32 values where shapes fit


def _decode_with_a_prefill_joining(engine: Engine, params: SamplingParams):
    """(the prompt decoded alone, the same decode while a 60-token prompt's prefill shares its steps)."""
    prompt, long_prompt = list(range(5, 15)), list(range(100, 160))
    [alone] = engine.generate([prompt], params)
    stream = engine.submit(prompt, params)
    outputs = [next(stream)]
    other = engine.submit(long_prompt, params)
    time.sleep(0.01)
    outputs += list(stream)
    list(other)
    return alone.choices[0], outputs


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_engine_packs_for_its_path_and_a_decode_does_not_depend_on_its_neighbours(default_tokenizer,
                                                                                          path_kernels, mode):
    require_op(path_kernels.q8_mm if mode == "int8" else path_kernels.int4_mm, mode)
    # native_decode off: the C++ step serves pure decode steps and not mixed ones, whose float order differs.
    engine, _ = tiny_quantized_engine("llama", mode, default_tokenizer, path=path_kernels, native_decode=False)
    try:
        model = engine.loaded.model
        assert all(type(m) is not torch.nn.Linear for m in model.modules())
        assert isinstance(model.lm_head, layers.PackedQ8Linear)  # int8 per 32 values in both modes
        packed = [m for m in model.modules() if isinstance(m, PACKED[mode])]
        assert len(packed) == 2 * 4 + (mode == "int8")  # qkv, o, gate_up, down per layer (+ the lm_head)
        alone, outputs = _decode_with_a_prefill_joining(
            engine, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1))
        # The prefill's 60 rows share steps with the decode, whose row must come out of the kernel with the
        # same bits as when it ran alone.
        assert [t for o in outputs for t in o.token_ids] == alone.token_ids
        assert [e.logprob for o in outputs for e in o.logprobs] == [e.logprob for e in alone.logprobs]
    finally:
        engine.stop()


def test_bf16_engine_packs_its_matrices_once_and_agrees_with_its_unpacked_twin(default_tokenizer, path_kernels):
    require_op(path_kernels.bf16_mm, "bf16")
    _, loaded = build_tiny(tiny_config("llama", tie_word_embeddings=True), default_tokenizer, dtype=torch.bfloat16,
                           path=path_kernels)
    twin = copy.deepcopy(loaded)  # aten's F.linear on the same bf16 weights
    quant.pack_for_cpu(loaded.model, path_kernels)
    model = loaded.model
    linears = [m for m in model.modules() if isinstance(m, layers.PackedBf16Linear)]
    assert len(linears) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the lm_head
    assert model.lm_head.weight_packed is model.model.embed_tokens.weight_packed  # tied: one matrix
    assert sizes.weight_bytes(model) == sizes.weight_bytes(twin.model)
    assert sizes.num_parameters(model) == sizes.num_parameters(twin.model)

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    results = {}
    for name, which in (("packed", loaded), ("twin", twin)):
        engine = Engine(EngineConfig(dtype="bfloat16", device="cpu"), loaded=which).start()
        try:
            results[name] = _decode_with_a_prefill_joining(engine, params)
        finally:
            engine.stop()
    alone, outputs = results["packed"]
    # Every step computes a row the same way, so a sequence's tokens do not depend on what shares its steps.
    assert [t for o in outputs for t in o.token_ids] == alone.token_ids
    assert [e.logprob for o in outputs for e in o.logprobs] == [e.logprob for e in alone.logprobs]
    # Against aten's bf16 matmul: the first token's distribution agrees to bf16 rounding (later tokens may part
    # at a near tie: the tiny random model's distribution is nearly uniform).
    twin_first = dict(results["twin"][0].logprobs[0].top)
    for token, logprob in alone.logprobs[0].top:
        assert abs(twin_first.get(token, -99.0) - logprob) < 0.05
