"""Shared fixtures: tiny random-weight engines (fast), the real default model, and a live server subprocess."""
from __future__ import annotations

import copy
import functools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from engine import Engine, EngineConfig, kernels
from engine.config import default_cache_dir
from engine.registry import ModelRegistry, ModelSpec
from engine.weights.checkpoint import default_gguf_path, dequantized_checkpoint
from engine.weights.loader import LoadedModel, build_native
from engine.models import NATIVE_MODELS

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
SERVER_PIDS: dict[str, int] = {}  # base URL -> process id of the servers the fixtures started


@pytest.fixture(scope="session")
def default_checkpoint() -> Path:
    """The default model de-quantized by transformers into an fp32 folder (once, then cached): the float reference
    the engine's answers are held to, and a Hugging Face folder for the tests that load one."""
    return dequantized_checkpoint(default_gguf_path(), default_cache_dir())


@pytest.fixture(scope="session")
def default_tokenizer(request):
    """The default model's tokenizer; TERN_TEST_TOKENIZER names a folder holding only tokenizer files, for
    machines (the GPU box) where the default model itself is not installed and only tiny models run."""
    from transformers import AutoTokenizer

    folder = os.environ.get("TERN_TEST_TOKENIZER") or request.getfixturevalue("default_checkpoint")
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="session")
def default_engine():
    """The real default model in fp32, so parity with transformers can be exact."""
    engine = Engine(EngineConfig(dtype="float32")).start()
    yield engine
    engine.stop()


def tiny_config(model_type: str = "llama", vocab_size: int = 49152, **overrides):
    """A small random config of a native architecture (or any transformers one for the generic path)."""
    from transformers import AutoConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=2,
        bos_token_id=1,
        tie_word_embeddings=False,
    )
    if model_type == "gpt2":
        common = dict(vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=4, n_positions=512, eos_token_id=2, bos_token_id=1)
    if model_type == "qwen3":
        common["head_dim"] = 16
    common.update(overrides)
    return AutoConfig.for_model(model_type, **common)


def build_tiny(hf_config, tokenizer, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32,
               path: kernels.CpuKernels | None = None):
    """(transformers model, LoadedModel for the engine) sharing the same random weights; on CPU the engine uses
    `path`'s kernels (default: the ones the engine would pick here)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    device = torch.device(device)
    hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():  # random init of RMSNorm weights is all ones; perturb so norms are exercised
        for name, param in hf_model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    native = hf_config.model_type in NATIVE_MODELS
    if native:
        model = build_native(hf_config, dict(hf_model.state_dict()), dtype, device)
        hf_model = hf_model.to(device=device, dtype=dtype)
    else:
        model = hf_model = hf_model.to(device=device, dtype=dtype)
    loaded = LoadedModel(model, tokenizer, hf_config, f"tiny-{hf_config.model_type}", ROOT, native, device, dtype,
                         kernels=(path or cpu_kernels()) if device.type == "cpu" else kernels.CpuKernels("off", "not a CPU"))
    return hf_model, loaded


def cpu_kernels() -> kernels.CpuKernels:
    """The kernels the engine would pick here (TERN_CPU_KERNELS forces a path), built once per session."""
    return kernels.select(default_cache_dir())


@pytest.fixture(params=kernels.PATHS)
def path_kernels(request) -> kernels.CpuKernels:
    """The operators of one kernel path (amx, avx512, avx2, off), built for this machine: a test using it runs once
    per path, and a path this CPU cannot take is skipped with the reason, so the summary says which ran here."""
    try:
        return kernels.kernels_for(request.param, default_cache_dir())
    except kernels.KernelsUnavailable as exc:
        pytest.skip(f"kernel path {request.param}: {exc}")


def pytest_collection_modifyitems(items) -> None:
    """Marks `every_path` the tests that take their kernels from `path_kernels`: they run once per path, `off`
    included, whatever TERN_CPU_KERNELS says, so `make test`'s second pass (the engine with the kernels off)
    deselects them instead of running them all again."""
    for item in items:
        if "path_kernels" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.every_path)


def require_op(op, what: str):
    """The op, or skip the test: the `off` path (and avx2, for bf16) leaves that work to aten."""
    if op is None:
        pytest.skip(f"this path has no {what} kernel: aten serves it")
    return op


def tiny_quantized_engine(model_type: str, mode: str, tokenizer, device: str = "cpu", dtype: str = "float32",
                          path: kernels.CpuKernels | None = None, before_quantizing=None, **engine_config):
    """(engine on the tiny model quantized with `mode` and packed for `path`'s kernels, float transformers twin
    with the same weights). `before_quantizing(model)` may change the float model's weights first."""
    from engine.weights import quant

    hf_model, loaded = build_tiny(tiny_config(model_type), tokenizer, seed=0, device=device, dtype=getattr(torch, dtype),
                                  path=path)
    if loaded.model is hf_model:  # the generic path serves the transformers model itself: keep a float twin
        loaded.model = copy.deepcopy(hf_model)
    if before_quantizing is not None:
        with torch.no_grad():
            before_quantizing(loaded.model)
    quant.quantize(loaded.model, mode, loaded.device, loaded.dtype)
    if loaded.device.type == "cpu":
        quant.pack_for_cpu(loaded.model, loaded.kernels)
    loaded.quantization = mode
    config = EngineConfig(dtype=dtype, device=device, quantization=mode, **engine_config)
    return Engine(config, loaded=loaded).start(), hf_model


@pytest.fixture
def tiny_engine_factory(default_tokenizer):
    """Build engines on tiny random models; every engine made is stopped after the test."""
    engines = []

    def make(model_type: str = "llama", seed: int = 0, config_overrides: dict | None = None, device: str = "cpu",
             dtype: str = "float32", **engine_config):
        hf_config = tiny_config(model_type, **(config_overrides or {}))
        hf_model, loaded = build_tiny(hf_config, default_tokenizer, seed, device, getattr(torch, dtype))
        engine = Engine(EngineConfig(dtype=dtype, device=device, **engine_config), loaded=loaded).start()
        engines.append(engine)
        return engine, hf_model

    yield make
    for engine in engines:
        engine.stop()


def api_app(engine: Engine):
    """The real API routes over a started engine (with their request ids and error handlers), as a FastAPI app for
    an in-process TestClient."""
    from fastapi import FastAPI

    from api import RequestIDMiddleware, build_router, install_error_handlers
    from engine import EngineHandle

    handle = EngineHandle()
    handle.set_engine(engine)
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(RequestIDMiddleware)
    app.include_router(build_router(handle))
    return app


@pytest.fixture
def tiny_api(tiny_engine_factory):
    """(engine, TestClient) serving the tiny llama, whose tokenizer is the default model's, behind the real API
    routes, for tests of what a client sees."""
    from fastapi.testclient import TestClient

    engine, _ = tiny_engine_factory()
    with TestClient(api_app(engine)) as client:
        yield engine, client


def sse_chunks(response) -> list[dict]:
    """The JSON chunks of a streamed answer, after checking it ended with [DONE]."""
    assert response.status_code == 200, response.text
    data = [line[len("data: "):] for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


# Fields of a family's config class that Tern never reads: use_cache (PreTrainedConfig takes it out of its fields)
# and model_type (compared in assert_config_reads_back: to_dict writes the class's).
CONFIG_FIELDS_NOT_READ = {"use_cache", "model_type"}


def assert_config_reads_back(gguf_path: Path, cache_dir: Path) -> None:
    """The config Tern writes from a GGUF's metadata, read back without the family's config class (read_config: a
    faster start), holds every field the family's class gives it (AutoConfig on the same folder)."""
    from transformers import AutoConfig

    from engine.weights import checkpoint

    folder = checkpoint.gguf_metadata(gguf_path, cache_dir)
    fast, full = checkpoint.read_config(folder, cache_dir), AutoConfig.from_pretrained(folder)
    assert type(fast) is not type(full), "read_config went through AutoConfig"
    assert fast.model_type == full.model_type
    expected = {k: v for k, v in full.to_dict().items() if k not in CONFIG_FIELDS_NOT_READ}
    assert {k: getattr(fast, k, "<missing>") for k in expected} == expected


def assert_tokenizer_as_autotokenizer(gguf_path: Path, cache_dir: Path) -> None:
    """The tokenizer Tern loads from a GGUF's metadata folder (load_tokenizer: without AutoTokenizer where it may, a
    faster start) is the one AutoTokenizer builds there: the same class and settings, the same tokens for text with
    special tokens in it, the same text back, the same chat prompt."""
    from transformers import AutoTokenizer

    from engine.weights import checkpoint

    folder = checkpoint.gguf_metadata(gguf_path, cache_dir)
    hf_config = checkpoint.read_config(folder, cache_dir)
    fast, full = checkpoint.load_tokenizer(folder, hf_config, cache_dir), AutoTokenizer.from_pretrained(folder, config=hf_config)
    assert type(fast) is type(full)
    assert fast.init_kwargs == full.init_kwargs
    assert fast.added_tokens_decoder == full.added_tokens_decoder
    assert (fast.all_special_ids, fast.bos_token_id, fast.eos_token_id, fast.pad_token_id) == (
        full.all_special_ids, full.bos_token_id, full.eos_token_id, full.pad_token_id)
    special = "".join(full.all_special_tokens)
    text = f"{special}The capital of France is Paris.\n\tCafé 🐦 中文 {special} 1234  end"
    assert fast.encode(text) == full.encode(text)
    ids = full.encode(text)
    assert fast.decode(ids) == full.decode(ids)
    assert fast.decode(ids, skip_special_tokens=True) == full.decode(ids, skip_special_tokens=True)
    if full.chat_template:
        messages = [{"role": "user", "content": "Name three birds."}]
        assert fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            full.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def heavy_imports_of_a_start(gguf_path: Path, cache_dir: Path) -> list[str]:
    """What of transformers' activation table and models package, torch._dynamo and torch.distributed.tensor a fresh
    process imports to start an engine on a GGUF after its first start (which writes the config and tokenizer from
    the file once). With what they pull in they were ~1.5 s of a 2-core server's start (bench/startup.py), and
    transformers.models alone (which AutoTokenizer and AutoConfig import) 0.5-1 s more."""
    from engine.weights.checkpoint import gguf_metadata

    gguf_metadata(gguf_path, cache_dir)  # the first start's conversion
    # and the CPU kernels it built: the test session's own (in a fresh folder the process would build them again,
    # ~50-80 s on 2 cores, and a first start is not what is measured)
    cpu_kernels()
    if (default_cache_dir() / "kernels").is_dir():  # not where the kernel path is off
        (cache_dir / "kernels").symlink_to(default_cache_dir() / "kernels", target_is_directory=True)
    heavy = ["transformers.activations", "transformers.models", "torch._dynamo", "torch.distributed.tensor"]
    code = ("import json, sys\n"
            "from engine import Engine, EngineConfig\n"
            f"Engine(EngineConfig.serving(model={str(gguf_path)!r}, cache_dir={str(cache_dir)!r})).start().stop()\n"
            f"print(json.dumps([m for m in {heavy!r} if m in sys.modules]))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(*args: str, env: dict | None = None, log_name: str = "server") -> tuple[subprocess.Popen, str, Path]:
    """Start app.py on 127.0.0.1 and a free port; returns (process, base URL, log file)."""
    port = free_port()
    ARTIFACTS.mkdir(exist_ok=True)
    log_path = ARTIFACTS / f"{log_name}-{port}.log"
    log = open(log_path, "w")
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "app.py"), "--host", "127.0.0.1", "--port", str(port), *args],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    return process, f"http://127.0.0.1:{port}", log_path


def wait_healthy(process: subprocess.Popen, base_url: str, log_path: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"server not healthy after {timeout_s}s:\n{log_path.read_text()[-3000:]}")


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


@pytest.fixture(scope="session")
def live_server(default_checkpoint):
    """The real server on the default model in fp32, unquantized and with an fp32 KV cache (its answers are
    transformers'), compiling its decode step before it says ready as the server does by default; shared by the
    end-to-end tests. Yields its base URL."""
    process, base_url, log_path = start_server("--dtype", "float32", "--quantization", "none", "--kv-cache-dtype",
                                               "auto", log_name="live-server")
    SERVER_PIDS[base_url] = process.pid
    try:
        wait_healthy(process, base_url, log_path, timeout_s=900)  # a cold inductor cache: minutes on 2 cores
        yield base_url
    finally:
        stop_server(process)


# Ray Serve (deploy/): one local Ray cluster for the session, small and shut down at the end.
RAY_OBJECT_STORE_BYTES = 128 * 1024 * 1024
RAY_REPLICA_CPUS = 0.5  # two replicas on a 2-core machine, and room for Ray to start a third while one restarts


@pytest.fixture(scope="session")
def ray_serve():
    """A local Ray cluster (no dashboard, a bounded object store) with Serve's proxy on 127.0.0.1 and a free port;
    yields the base URL. Skips where Ray is not installed (`make test` installs requirements-ray.txt)."""
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        pytest.skip(f"Ray is not installed ({exc}): pip install -r requirements-ray.txt")
    from deploy.ray_serve import ScaleSettings, connect

    connect(ScaleSettings(ray_address="local", object_store_memory_bytes=RAY_OBJECT_STORE_BYTES))
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy_on_ray(*tern_flags: str, **scale) -> None:
    """Serve Tern as app "tern" at "/" on the session's cluster, with app.py's flags and ScaleSettings' fields;
    returns once every replica has loaded its model."""
    from ray import serve

    from deploy.ray_serve import ScaleSettings, build_app, parse_args

    server, engine_config, _ = parse_args(["--host", "127.0.0.1", "--no-compile", *tern_flags])
    scale = ScaleSettings(**{"num_cpus": RAY_REPLICA_CPUS, **scale})
    serve.run(build_app(server, engine_config, scale), name="tern", route_prefix="/")


def undeploy_from_ray() -> None:
    from ray import serve

    serve.delete("tern")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, default_checkpoint) -> Path:
    """A random tiny Llama saved as a checkpoint folder with the default model's tokenizer and chat template: a
    replica loads it in about a second (bench/random_checkpoint.py's "tiny")."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("random_checkpoint", ROOT / "bench" / "random_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # by path: bench/ on sys.path would shadow the `kernels` package transformers probes
    return module.make_random_checkpoint("tiny", default_checkpoint, tmp_path_factory.mktemp("tiny"), torch.float32)


@functools.lru_cache(maxsize=1)
def _default_tokenizer_metadata() -> dict:
    """The default model's tokenizer fields, read from its GGUF once per session: gguf's reader takes seconds over
    a 49,152-token vocabulary and its merges."""
    from gguf import GGUFReader

    reader = GGUFReader(default_gguf_path())

    def strings(key):
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    def scalar(key):
        field = reader.fields[key]
        return field.parts[field.data[0]][0].item()

    token_types = reader.fields["tokenizer.ggml.token_type"]
    return dict(model=bytes(reader.fields["tokenizer.ggml.model"].parts[-1]).decode(),
                pre=bytes(reader.fields["tokenizer.ggml.pre"].parts[-1]).decode(),
                tokens=strings("tokenizer.ggml.tokens"),
                token_types=[int(token_types.parts[i][0]) for i in token_types.data],
                merges=strings("tokenizer.ggml.merges"),
                bos=scalar("tokenizer.ggml.bos_token_id"), eos=scalar("tokenizer.ggml.eos_token_id"),
                chat_template=bytes(reader.fields["tokenizer.chat_template"].parts[-1]).decode())


# The vocabulary of the tiny GGUFs the tests write: the default model's first 1,024 tokens (its special tokens, the
# 235 byte symbols and the first merges). Every GGUF reader (gguf's, transformers', the first start's) parses the
# tokens and merges field by field in Python: the full 49,152 took most of each tiny GGUF test's 20-40 s.
TINY_GGUF_VOCAB = 1024


def tokenizer_fields(writer, vocab_size: int | None = TINY_GGUF_VOCAB) -> int:
    """The default model's tokenizer, copied from its GGUF (transformers rebuilds the tokenizer from these), cut to
    its first `vocab_size` tokens (None: all) and the merges among them; returns the vocabulary's size."""
    meta = _default_tokenizer_metadata()
    tokens = meta["tokens"][:vocab_size]
    kept = set(tokens)
    # BPE stays whole: a merge is kept when both its parts and what it makes are in the cut vocabulary.
    merges = [m for m in meta["merges"] if m.replace(" ", "", 1) in kept and all(p in kept for p in m.split(" ", 1))]
    writer.add_tokenizer_model(meta["model"])
    writer.add_tokenizer_pre(meta["pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(meta["token_types"][:len(tokens)])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(meta["bos"])
    writer.add_eos_token_id(meta["eos"])
    writer.add_chat_template(meta["chat_template"])
    return len(tokens)


@pytest.fixture(scope="session")
def tiny_vocab_tokenizer(tmp_path_factory):
    """The default model's tokenizer cut to its first TINY_GGUF_VOCAB tokens, as the tiny GGUFs carry it: for tiny
    models that are written as GGUFs (a vocabulary that size keeps every GGUF reader quick)."""
    from gguf import GGUFWriter
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-vocab") / "tokenizer.gguf"
    writer = GGUFWriter(path, "llama")
    tokenizer_fields(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


# Thinking models: Qwen3's real chat template (tests/fixtures/README.md says where it comes from), and the shape of
# DeepSeek-R1's, whose generation prompt opens the <think> block so that the model's first words are reasoning.
QWEN3_TEMPLATE = (ROOT / "tests" / "fixtures" / "qwen3_chat_template.jinja").read_text()
OPENING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}{# ends with </think> #}")


def thinking_engine(default_tokenizer, template: str) -> tuple[Engine, int]:
    """(started engine, `<think>` token id): a tiny random Qwen3 on the default model's tokenizer with `<think>` and
    `</think>` added as Qwen3 has them (added tokens, not special ones) and this chat template."""
    tokenizer = copy.deepcopy(default_tokenizer)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = template
    _, loaded = build_tiny(tiny_config("qwen3", vocab_size=len(tokenizer)), tokenizer)
    return Engine(EngineConfig(dtype="float32"), loaded=loaded).start(), tokenizer.convert_tokens_to_ids("<think>")


# The UI's handlers take a ModelRegistry: real registries whose models are engines the tests made (the shared default
# model, tiny random ones), loaded through the registry's own load path.
def registry_over(builders: dict, max_loaded: int | None = None, preload: bool = True) -> ModelRegistry:
    """A started registry serving one model per id, built by its builder when the registry loads it. With preload,
    every model is loaded before this returns (by leasing it once), as a server's are once it says ready."""
    specs = [ModelSpec(model_id, EngineConfig(model=model_id)) for model_id in builders]
    registry = ModelRegistry(specs, max_loaded=max_loaded, load=lambda config: builders[config.model]()).start()
    if preload:
        for model_id in builders:
            registry.acquire(model_id, timeout_s=120).release()
    return registry


@pytest.fixture
def tiny_registry(tiny_engine_factory):
    """Make registries over tiny random engines: registry({"a": seed, "b": seed}, ...); each model is a tiny Llama
    with that seed's weights, built only when the registry loads it. Every engine is stopped after the test."""
    registries = []

    def make(seeds: dict[str, int], max_loaded: int | None = None, preload: bool = True):
        builders = {model_id: (lambda seed=seed: tiny_engine_factory(seed=seed)[0]) for model_id, seed in seeds.items()}
        registries.append(registry_over(builders, max_loaded=max_loaded, preload=preload))
        return registries[-1]

    yield make
    for registry in registries:
        registry.stop()
