"""Engine.info(): the one description of an engine that api/ and ui/ render."""
from __future__ import annotations

import dataclasses

import pytest
from conftest import build_tiny, tiny_config

from engine import Engine, EngineConfig


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_info_describes_the_engine_as_it_runs_on_either_path(default_tokenizer, model_type):
    _, loaded = build_tiny(tiny_config(model_type), default_tokenizer)
    engine = Engine(EngineConfig(max_num_seqs=4, max_waiting=7), loaded=loaded).start()
    try:
        info = engine.info()
        assert (info.max_num_seqs, info.max_waiting) == (4, 7)
        assert info.decode_step == engine.runner.decode_step and info.device == "cpu" and info.dtype == "float32"
        assert info.weight_bytes == loaded.weight_bytes and 0 < info.weight_ratio_to_bf16
        assert info.weights_settled  # loaded before the engine: no move into huge pages is due
        if model_type == "llama":  # the native path's KV pool, counted in the Server tab's memory
            assert info.kv_cache_bytes == engine.kv_cache.num_bytes > 0 and info.kv_cache_dtype == "float32"
            assert engine.kv_cache.wait_resident(60) and engine.info().kv_cache_resident
        else:  # the generic path recomputes every step and keeps no cache
            assert engine.kv_cache is None and info.kv_cache_bytes == 0 and info.kv_cache_dtype == "none"
            assert info.kv_cache_resident  # no pool to wait for
        # The longest context it reports is the one it enforces.
        too_long = list(range(3, 3 + info.max_model_len + 1))
        with pytest.raises(Exception, match="context|length|long"):
            engine.generate([too_long], engine_params())
        with pytest.raises(dataclasses.FrozenInstanceError):
            info.max_num_seqs = 8  # a snapshot: changing it changes nothing
    finally:
        engine.stop()


def engine_params():
    from engine import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0)
