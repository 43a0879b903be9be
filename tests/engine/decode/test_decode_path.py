"""The decode path, decided once: the planner picks native / compiled / eager (and CUDA graphs, the attention kernel)
from the config, the model and the device, and says why; build_runner's runner follows it on its own: it compiles in
the background in blocks it reserves, and serves steps without the engine writing into it."""
from __future__ import annotations

import threading
import time

import torch
from conftest import build_tiny, cpu_kernels, tiny_config

from engine import EngineConfig
from engine.decode import compiled
from engine.decode.compiled import WARMUP_BLOCKS
from engine.weights import quant
from engine.decode.decode_path import build_runner, plan_decode_path
from engine.kv_cache import BlockAllocator, KVCache
from engine.params import SamplingParams
from engine.request import Request, Sequence
from engine.decode.runner import ModelRunner
from engine.scheduler import Scheduler

NUM_BLOCKS = 32


def _loaded(tokenizer, path, mode: str = "none", dtype=torch.float32, model_type: str = "llama"):
    """A tiny model quantized with `mode` and packed for `path`, as the loader hands it over, and a KV cache."""
    _, loaded = build_tiny(tiny_config(model_type), tokenizer, dtype=dtype, path=path)
    quant.quantize(loaded.model, mode, loaded.device, dtype)
    quant.pack_for_cpu(loaded.model, path)
    loaded.quantization = mode
    if not loaded.is_native:
        return loaded, None
    model = loaded.model
    kv_cache = KVCache(model.config.num_hidden_layers, NUM_BLOCKS, 16, model.num_kv_heads, model.head_dim, dtype,
                       loaded.device)
    model.build_rope_tables(NUM_BLOCKS * 16, loaded.device, dtype)
    return loaded, kv_cache


def test_the_planner_picks_native_compiled_or_eager_per_config_and_says_why(default_tokenizer, path_kernels):
    has_native = path_kernels.q8_mm is not None and path_kernels.decode_attention is not None
    int8, kv_cache = _loaded(default_tokenizer, path_kernels, "int8")

    path = plan_decode_path(EngineConfig(quantization="int8", compile=True), int8, kv_cache)
    if has_native:  # C++ serves, so nothing needs compiling
        assert path.step == "native" and path.kernels is path_kernels and path_kernels.path in path.reason
    else:
        assert path.step == "compiled" and f"the native step: the CPU kernel path is {path_kernels.path}" in path.reason
    assert path.attention_kernel is path_kernels.decode_attention
    assert not path.graphs  # the config asks for CUDA graphs by default; a CPU has none

    path = plan_decode_path(EngineConfig(quantization="int8", native_decode=False, compile=True), int8, kv_cache)
    assert path.step == "compiled" and path.is_compiled_in_background
    assert "the native step is off" in path.reason and "compiled in the background" in path.reason

    path = plan_decode_path(EngineConfig(quantization="int8", native_decode=False), int8, kv_cache)
    assert path.step == "eager" and "compile is off" in path.reason

    bf16, bf16_cache = _loaded(default_tokenizer, path_kernels, "int8", torch.bfloat16)
    path = plan_decode_path(EngineConfig(dtype="bfloat16", quantization="int8"), bf16, bf16_cache)
    assert path.step == "eager"
    assert ("computes in float32" if has_native else "kernel path is") in path.reason

    generic, _ = _loaded(default_tokenizer, path_kernels, model_type="gpt2")
    path = plan_decode_path(EngineConfig(compile=True), generic, None)
    assert path.step == "eager" and "generic transformers path" in path.reason


def _decode_batch(runner, allocator, prompt_ids):
    """A prefill step, then a decode step, of one request scheduled as the engine would; the decode step's logits."""
    request = Request("r", prompt_ids, SamplingParams(temperature=0, max_tokens=4))
    seq = Sequence(0, request, 0, generator=None, output_text=None)
    seq.max_tokens = 4
    scheduler = Scheduler(allocator, 16, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.add(seq)
    for step in range(2):
        batch = scheduler.schedule()
        logits = runner.run(batch).sample_logits
        scheduler.mark_computed(batch)
        seq.token_ids.append(int(logits[0].argmax()))
    scheduler.finish(seq)
    assert batch.is_decode
    return logits


def test_a_runner_built_alone_compiles_in_the_background_in_blocks_it_reserves(default_tokenizer, monkeypatch):
    # torch.compile itself is test_compiled.py's; here the "compiled" forward is the eager one, so this is fast.
    monkeypatch.setattr(compiled, "compile_forward", lambda model: model.forward)
    may_build, built = threading.Event(), threading.Event()
    warm_up = ModelRunner.warm_up

    def held_warm_up(self, *args):
        assert may_build.wait(timeout=60)
        return warm_up(self, *args)

    monkeypatch.setattr(ModelRunner, "warm_up", held_warm_up)
    loaded, kv_cache = _loaded(default_tokenizer, cpu_kernels())
    allocator = BlockAllocator(NUM_BLOCKS)
    config = EngineConfig(native_decode=False, compile=True, max_num_seqs=4)
    runner = build_runner(config, loaded, kv_cache, allocator, NUM_BLOCKS * 16, built.set)
    try:
        assert runner.decode_step == "compiling" and not runner.decode_graphs
        assert runner.num_reserved_blocks == WARMUP_BLOCKS == NUM_BLOCKS - allocator.num_free
        assert not runner.has_reserved_blocks_to_free
        eager_logits = _decode_batch(runner, allocator, list(range(5, 25)))  # served while it builds
    finally:
        may_build.set()
    assert built.wait(timeout=60) and runner.wait_for_compiled_decode(timeout_s=60)
    assert runner.decode_step == "compiled" and runner.has_reserved_blocks_to_free
    runner.free_reserved_blocks()  # the engine thread's part: only it touches the allocator
    assert runner.num_reserved_blocks == 0 and allocator.num_free == NUM_BLOCKS
    assert torch.equal(_decode_batch(runner, allocator, list(range(5, 25))), eager_logits)


def test_stopping_ends_a_background_compile_and_waits_for_its_thread(default_tokenizer, monkeypatch):
    """A script that ends, or a model unloaded, while the decode step compiles: Engine.stop() ends the compile
    (interrupting the size it builds: test_compiled.py shows it on a real compile) and waits for its thread. Left
    running, that daemon thread was inside torch when the interpreter finalized, and the process died by
    std::terminate (exit status 134)."""
    monkeypatch.setattr(compiled, "compile_forward", lambda model: model.forward)
    compiling, sizes_built = threading.Event(), []
    warm_up = ModelRunner.warm_up

    def first_size_held_until_stopped(self, forward, blocks, cancelled):
        def build_one_size(*args):
            sizes_built.append(len(args[0]))
            compiling.set()
            deadline = time.monotonic() + 60
            while not cancelled() and time.monotonic() < deadline:  # a compile that outlasts the stop
                time.sleep(0.01)
            return forward(*args)
        return warm_up(self, build_one_size, blocks, cancelled)

    monkeypatch.setattr(ModelRunner, "warm_up", first_size_held_until_stopped)
    loaded, kv_cache = _loaded(default_tokenizer, cpu_kernels())
    allocator = BlockAllocator(NUM_BLOCKS)
    runner = build_runner(EngineConfig(native_decode=False, compile=True, max_num_seqs=4), loaded, kv_cache,
                          allocator, NUM_BLOCKS * 16, lambda: None)
    assert compiling.wait(timeout=60) and runner.decode_step == "compiling"
    runner.stop_compiling()
    assert not any(thread.name == "tern-compile" for thread in threading.enumerate())
    assert len(sizes_built) == 1 < len(compiled.warmup_batch_sizes(4))  # the next sizes were not built
    assert runner.decode_step == "eager"  # ended without a compiled step: the eager one serves
    runner.free_reserved_blocks()
    assert allocator.num_free == NUM_BLOCKS


def test_a_failed_compile_leaves_the_eager_step_serving_and_frees_its_blocks(default_tokenizer, monkeypatch):
    def failing_warm_up(self, *args):
        raise RuntimeError("inductor could not build")

    monkeypatch.setattr(compiled, "compile_forward", lambda model: model.forward)
    monkeypatch.setattr(ModelRunner, "warm_up", failing_warm_up)
    loaded, kv_cache = _loaded(default_tokenizer, cpu_kernels())
    allocator = BlockAllocator(NUM_BLOCKS)
    runner = build_runner(EngineConfig(native_decode=False, compile=True), loaded, kv_cache, allocator,
                          NUM_BLOCKS * 16, lambda: None)
    assert not runner.wait_for_compiled_decode(timeout_s=60) and runner.decode_step == "eager"
    runner.free_reserved_blocks()
    assert allocator.num_free == NUM_BLOCKS
    _decode_batch(runner, allocator, [5, 6, 7])
