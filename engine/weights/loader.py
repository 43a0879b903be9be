"""Load a checkpoint (located by engine/weights/checkpoint.py): a GGUF file of a native architecture (the default
model's included) is read block by block into the layers that serve it (engine/weights/streamed_load.py), and so is a
safetensors folder whose weights are quantized here; other folders load their state dict whole.

Weights are read into process memory (not left mmap-backed): on small machines the kernel reclaims idle
file-backed pages and an mmap-backed model was seen slowing from 14 to 2 tokens/s.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import kernels
from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.models import NATIVE_MODELS
from engine.weights import quant, sizes, streamed_load
from engine.weights.checkpoint import gguf_file_of, load_tokenizer, open_gguf, read_config, resolve_checkpoint
from engine.weights.safetensors_folder import SafetensorsFolder

logger = logging.getLogger(__name__)



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
        """E.g. `weights in int4, q8: 115 MB (0.42x bf16)` or `bnb-nf4 weights: ...`, for the start-up log and
        the UI."""
        ratio = self.weight_bytes / max(self.bf16_weight_bytes, 1)
        return f"{self.describe_kind()}: {self.weight_bytes / 1e6:.0f} MB ({ratio:.2f}x bf16)"

    def describe_kind(self) -> str:
        """What the weights are held as: Tern's block layouts where they are used, most bytes first (a GGUF's
        K-quants are neither `int8` nor `int4`, whatever `auto` resolved to), else the quantization mode."""
        layouts = sizes.block_layouts(self.model)
        return f"weights in {', '.join(layouts)}" if layouts else f"{self.quantization} weights"


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
    cache_dir = config.cache_path
    device = choose_device(config.device)
    cpu_kernels = (kernels.select(cache_dir) if device.type == "cpu"
                   else kernels.CpuKernels("off", f"the model runs on {device.type}"))
    dtype = choose_dtype(config.dtype, device, config.quantization, cpu_kernels.path)
    if config.quantization != "auto":
        quant.check_supported(config.quantization, device, dtype)  # before minutes of converting or loading
    folder, name = resolve_checkpoint(config.model, cache_dir)
    hf_config = read_config(folder, cache_dir)
    tokenizer = load_tokenizer(folder, hf_config, cache_dir)  # not AutoConfig again: read_config says why
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
                                          q4k=cpu_kernels.q4k_mm is not None,
                                          q5k=cpu_kernels.q5k_mm is not None,
                                          q6k=cpu_kernels.q6k_mm is not None)
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


def _load_native(folder: Path, hf_config, dtype, device) -> torch.nn.Module:
    return build_native(hf_config, read_state_dict(folder), dtype, device)


def _load_generic(folder: Path, dtype, device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    for param in model.parameters():
        param.data = param.data.clone()  # own the memory rather than the safetensors mmap
    return model


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
