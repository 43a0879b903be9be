"""A GGUF file opened for serving: checked whole before any weight is read, then read one tensor at a time.

`GgufFile.open` parses the header with the `gguf` package's reader (which maps the file but touches only the
header), and refuses, naming the file, the tensor and the type, a file that is cut short, holds a tensor type Tern
cannot serve (engine/gguf_blocks.GGUF_TYPES). Tensors are then read with
pread into memory Tern owns (an mmap-backed model was seen slowing from 14 to 2 tokens/s on a small machine), so
at most one tensor's bytes are in flight beside the weights already converted.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import mmap
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from engine.errors import ModelLoadError
from engine.weights import quant
from engine.weights.gguf_blocks import GGUF_TYPES, dequantize, supported_names
from engine.kernels import GGUF_REPACK_LAYOUTS
from engine.models import NATIVE_MODELS

# The float types the kernels' repacking quantizes into q8 and int4 (a safetensors folder's rows of these names too).
REPACKED_FLOATS = (T.F32, T.F16, T.BF16)

# llama.cpp's converter reorders the rows of q and k for these (its RoPE pairs neighbours, HF's pairs halves).
PERMUTED_QK_ARCHITECTURES = ("llama",)
# ... and stores Gemma's RMSNorm weights plus one (its kernel multiplies by the weight; Gemma's norm by 1 + weight):
# transformers subtracts the one again when it reads these files (Gemma2TensorProcessor), and so does Tern.
NORM_PLUS_ONE_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
# GGUF architecture -> config.model_type where transformers names them differently (the rest are the same).
MODEL_TYPES = {"gemma3": "gemma3_text"}
# Tensors a GGUF may hold that these models do not use (long-context RoPE factors are in the config, too).
IGNORED_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")

# GGUF tensor name (per block) -> the transformers name the native model's state dict uses.
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Where an architecture's tensors differ (gguf-py's tensor map): Gemma 2 and 3 have a norm on each side of
# attention and of the MLP, so `ffn_norm` is the pre-MLP one; Phi-3 keeps q/k/v and gate/up fused.
_SANDWICH_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCHITECTURE_BLOCK_NAMES = {
    "gemma2": _SANDWICH_NAMES,
    "gemma3": _SANDWICH_NAMES,
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str, architecture: str | None = None) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for a name the models do not know."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, index, part = stem.split(".", 2)
        mapped = _ARCHITECTURE_BLOCK_NAMES.get(architecture, {}).get(part) or _BLOCK_NAMES.get(part)
        return None if mapped is None else f"model.layers.{index}.{mapped}.{kind}"
    mapped = _TOP_NAMES.get(stem)
    return None if mapped is None else f"{mapped}.{kind}"


class GgufFile:
    """The tensors of one GGUF file by their transformers names, each read on demand: a weight source for
    engine/weights/streamed_load.py."""

    def __init__(self, path: Path, architecture: str, tensors: dict) -> None:
        self.path = path
        self.architecture = architecture
        self._tensors = tensors  # transformers name -> TensorInfo
        self._scratch: np.ndarray | None = None  # the buffer reads share while reading() is open
        self._helper: ThreadPoolExecutor | None = None  # the thread reading half of each large read, likewise
        self._reordered: torch.Tensor | None = None  # likewise: where q and k rows are put back in order

    @classmethod
    def open(cls, path: Path, index: Path | None = None) -> "GgufFile":
        """Parse and check the file's header. `gguf`'s reader takes seconds over a large vocabulary (5.5 s for a
        49k-token one on 2 busy cores), so the tensor list it finds is kept in `index`, a small JSON file the caller
        names per version of the file, and later starts read that instead."""
        path = Path(path).resolve()
        stat = path.stat()
        return _open(path, stat.st_size, stat.st_mtime_ns, index)

    @classmethod
    def _parse(cls, path: Path, index: Path | None) -> "GgufFile":
        if index is not None and index.exists():
            saved = json.loads(index.read_text())
            architecture = saved["architecture"]
            found = [TensorInfo(name, T(kind), tuple(shape), n_bytes, offset)
                     for name, kind, shape, n_bytes, offset in saved["tensors"]]
        else:
            architecture, found = _read_header(path)
            if index is not None:
                _write_index(index, architecture, found)
        size = path.stat().st_size
        tensors = {}
        for tensor in found:
            end = tensor.data_offset + tensor.n_bytes
            if end > size:
                raise ModelLoadError(f"{path}: truncated: tensor {tensor.name} ends at byte {end:,}, "
                                     f"the file has {size:,}")
            if tensor.tensor_type not in GGUF_TYPES:
                raise ModelLoadError(f"{path}: tensor {tensor.name} is {tensor.tensor_type.name}, a type Tern "
                                     f"cannot serve (it serves {supported_names()})")
            if tensor.name in IGNORED_TENSORS:
                continue
            tensors[hf_name(tensor.name, architecture) or tensor.name] = tensor
        return cls(path, architecture, tensors)

    @property
    def is_native(self) -> bool:
        """Whether Tern has a native model for this file's architecture (else transformers' generic one serves)."""
        return self.model_type in NATIVE_MODELS

    @property
    def model_type(self) -> str | None:
        """The config.model_type transformers gives this file's architecture."""
        return MODEL_TYPES.get(self.architecture, self.architecture)

    @property
    def has_output_head(self) -> bool:
        """False when the lm_head is tied to the token embedding (the file stores that matrix once)."""
        return "lm_head.weight" in self._tensors

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        return list(self._tensors)

    def layout(self, name: str) -> str | None:
        """The Tern layout the file's blocks of this tensor go into as they are ("int4", "q4", "q4k", "q5k", "q6k",
        "q8"), or None."""
        layout = GGUF_TYPES[self._tensors[name].tensor_type].layout
        return None if layout == "dequantize" else layout

    def packed(self, name: str, num_heads: int | None = None, repack=None, out: torch.Tensor | None = None,
               layout: str | None = None) -> torch.Tensor:
        """The tensor in its layout's bytes (layouts.pack_int4, pack_q4, pack_q4k, pack_q5k, pack_q6k or pack_q8;
        `layout` "int4" puts q4 blocks in int4's, exactly, and q4k ones with their scales rounded to fp16), straight
        from its blocks: with the kernel library's `repack` (CpuKernels.gguf_repack) where given, else with
        gguf_blocks' torch twin; written into `out` where given (a fused projection's rows of this part)."""
        tensor = self._tensors[name]
        layout = layout or self.layout(name)
        if repack is not None:  # a new tensor or `out`: the bytes read are done with when it returns
            return repack(self.raw(name, num_heads, scratch=True), int(tensor.tensor_type), self.shape(name)[1],
                          GGUF_REPACK_LAYOUTS[layout], out)
        return _into(GGUF_TYPES[tensor.tensor_type].repack_into(layout)(self.raw(name, num_heads)), out)

    def q8(self, name: str, num_heads: int | None = None, repack=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The matrix in layouts.pack_q8's bytes: Q8_0 blocks as they are, Q4_0 and Q5_0 levels exactly under their
        own scales, any other type re-quantized per 32 values (quant.quantize_q8 of gguf's de-quantized values), by
        `repack` in one pass where given, else through float32 a few thousand rows at a time; written into `out`
        where given."""
        tensor = self._tensors[name]
        if repack is not None:
            return repack(self.raw(name, num_heads, scratch=True), int(tensor.tensor_type), self.shape(name)[1],
                          GGUF_REPACK_LAYOUTS["q8"], out)
        if GGUF_TYPES[tensor.tensor_type].holds("q8"):
            return self.packed(name, num_heads, out=out, layout="q8")
        return _into(torch.cat([quant.pack_q8(rows) for rows in self.float_rows(name, num_heads)]), out)

    def int4(self, name: str, num_heads: int | None = None, repack=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The matrix re-quantized into layouts.pack_int4's bytes per 32 values (quant.quantize_int4 of gguf's
        de-quantized values): F32, F16 and BF16 by `repack` in one pass where given, else through float32 a few
        thousand rows at a time; written into `out` where given."""
        tensor = self._tensors[name]
        if repack is not None and tensor.tensor_type in REPACKED_FLOATS:
            return repack(self.raw(name, num_heads, scratch=True), int(tensor.tensor_type), self.shape(name)[1],
                          GGUF_REPACK_LAYOUTS["int4"], out)
        return _into(torch.cat([quant.pack_int4(rows) for rows in self.float_rows(name, num_heads)]), out)

    def type_name(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """In torch's order: [rows, columns] for a matrix (GGUF lists dimensions innermost first)."""
        return tuple(int(n) for n in reversed(self._tensors[name].shape))

    @contextlib.contextmanager
    def reading(self):
        """Within it the repacking reads (packed, q8) share one buffer of the largest tensor's size, whose pages the
        process faults in once: a fresh buffer per tensor faulted in every page again, which costs ~3 us a page on
        these VMs (1.8 s of a 3.4 GB Q8_0 file's 2.3 s of reads). The buffer is freed when the block ends. Each
        large read is split between this thread and one helper (_read_into)."""
        self._scratch = np.empty(max(t.n_bytes for t in self._tensors.values()), dtype=np.uint8)
        self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tern-gguf-read")
        try:
            yield self
        finally:
            self._scratch = self._reordered = None
            self._helper.shutdown()
            self._helper = None

    def raw(self, name: str, num_heads: int | None = None, scratch: bool = False) -> torch.Tensor:
        """The tensor's bytes, [rows, bytes per row] for a matrix, in memory of its own (`scratch`, inside
        reading(): in the shared buffer, which the next such read overwrites); q and k rows put back in
        transformers' order where the converter reordered them (`num_heads`: the heads of this matrix)."""
        tensor = self._tensors[name]
        if scratch and self._scratch is not None:
            data = self._scratch[:tensor.n_bytes]
        else:
            data = np.empty(tensor.n_bytes, dtype=np.uint8)
        with open(self.path, "rb") as file:
            whole = _read_into(file.fileno(), memoryview(data), tensor.data_offset, self._helper)
        if not whole:
            raise ModelLoadError(f"{self.path}: truncated: tensor {tensor.name} could not be read whole")
        shape = self.shape(name)
        raw = torch.from_numpy(data).reshape(shape[0], -1) if len(shape) > 1 else torch.from_numpy(data)
        if num_heads is not None and self.architecture in PERMUTED_QK_ARCHITECTURES:
            raw = _unpermuted(raw, num_heads, self._reordering_buffer(raw.numel()) if scratch else None)
        return raw

    def _reordering_buffer(self, n_bytes: int) -> torch.Tensor | None:
        """Inside reading(): memory that a scratch read's q or k rows are put back in order into, kept for the next
        (fresh memory per matrix faulted in again each time, 0.3 s of a 3B-shaped file's load); grown as needed."""
        if self._scratch is None:
            return None
        if self._reordered is None or self._reordered.numel() < n_bytes:
            self._reordered = torch.empty(n_bytes, dtype=torch.uint8)
        return self._reordered[:n_bytes]

    def float(self, name: str, num_heads: int | None = None) -> torch.Tensor:
        """The tensor de-quantized to float32 with `gguf`'s reference, rows in transformers' order."""
        tensor = self._tensors[name]
        raw = self.raw(name, num_heads)
        values = dequantize(raw.numpy(), tensor.tensor_type, self.shape(name))
        if self.architecture in NORM_PLUS_ONE_ARCHITECTURES and name.endswith("norm.weight"):
            values = values - 1
        return values

    def float_rows(self, name: str, num_heads: int | None = None, rows: int = 4096):
        """The matrix de-quantized `rows` rows at a time (float32 [<= rows, columns] each): an 8B model's 128k-row
        embedding is 2 GB in float32, never whole in memory this way."""
        tensor = self._tensors[name]
        raw = self.raw(name, num_heads)
        columns = self.shape(name)[1]
        for chunk in raw.split(rows):
            yield dequantize(chunk.numpy(), tensor.tensor_type, (chunk.shape[0], columns))


# Reads from here up go half on a helper thread: one thread copies from the page cache at ~4 GB/s during a load (the
# 3B-shaped Q8_0 file's 3.1 GB: 0.75 s of its 2.3 s), two at about twice that.
_SPLIT_READ_BYTES = 8 << 20


def _read_into(fd: int, buffer: memoryview, offset: int, helper: ThreadPoolExecutor | None) -> bool:
    """Fill `buffer` with the file's bytes from `offset` (the second half on `helper`'s thread where given and the
    read is large): whether all of them were there. Loops over short reads (Linux returns at most ~2 GiB a call)."""
    if helper is not None and len(buffer) >= _SPLIT_READ_BYTES:
        half = len(buffer) // 2 // mmap.PAGESIZE * mmap.PAGESIZE
        second = helper.submit(_read_into, fd, buffer[half:], offset + half, None)
        try:
            first = _read_into(fd, buffer[:half], offset, None)
        finally:  # the buffer is not handed back while the helper still writes into it
            rest = second.result()
        return first and rest
    while len(buffer):
        read = os.preadv(fd, [buffer], offset)
        if read == 0:
            return False
        buffer, offset = buffer[read:], offset + read
    return True


def _into(tensor: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return tensor if out is None else out.copy_(tensor)


class TensorInfo(NamedTuple):
    """Where a tensor's bytes are and what they hold (the fields of gguf's ReaderTensor that loading uses)."""
    name: str
    tensor_type: T
    shape: tuple[int, ...]  # GGUF's order: innermost dimension first
    n_bytes: int
    data_offset: int


class HeaderReader(gguf.GGUFReader):
    """gguf's reader with its map seen as a plain ndarray: the same fields and tensors, but each of the ~200,000 small
    views a 49k-token vocabulary's header takes costs numpy's C code, not numpy.memmap's Python hooks (the 1B-shaped
    Q4_0 file: 0.57 s instead of 1.81 on a 2-core AMD EPYC VM). The views still read the mapped file."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, mapped: np.memmap) -> None:  # set once, by GGUFReader.__init__, before it parses
        self._data = mapped.view(np.ndarray)


_headers_read: dict[str, HeaderReader] | None = None  # while reading_headers_once() is open: path -> its reader
_reading_once = threading.RLock()  # one thread at a time swaps gguf's reader (two models may load at once)


def _file_key(path) -> str:
    """One file, however a caller names it: the key of the per-file parses within reading_headers_once()."""
    return str(Path(path).resolve())


def header_reader(path, *args, **kwargs) -> HeaderReader:
    """The file's parsed header: within reading_headers_once() the one parse all readers share, else a new one."""
    parsed = _headers_read
    if parsed is None:
        return HeaderReader(path, *args, **kwargs)
    key = _file_key(path)
    if key not in parsed:
        parsed[key] = HeaderReader(path, *args, **kwargs)
    return parsed[key]


@contextlib.contextmanager
def reading_headers_once():
    """Within this block each GGUF's header is parsed once, by whoever asks first: Tern (_read_header), gguf_config,
    and transformers, which parses a file once for its config and again for its tokenizer (its 49,152-entry
    vocabulary one view at a time), decodes its metadata as often (_metadata_parsed_once, where the caller imported
    transformers' GGUF module; nothing here imports transformers for it) and builds gguf's tensor-name map once per
    module (397 times for SmolLM2): seconds of a new file's first start on 2 cores. Re-entrant; the parsed headers
    are dropped and every function swapped in is put back at the end."""
    global _headers_read
    with _reading_once:
        if _headers_read is not None:  # nested in this thread's own block
            yield
            return
        swaps = [(gguf, "GGUFReader", header_reader),
                 (gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))]
        transformers_gguf = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
        if transformers_gguf is not None:
            swaps.append((transformers_gguf, "load_gguf_checkpoint",
                          _metadata_parsed_once(transformers_gguf.load_gguf_checkpoint)))
        originals = [(module, name, getattr(module, name)) for module, name, _ in swaps]
        _headers_read = {}
        for module, name, replacement in swaps:
            setattr(module, name, replacement)
        try:
            yield
        finally:
            for module, name, original in originals:
                setattr(module, name, original)
            _headers_read = None


def _metadata_parsed_once(parse_metadata):
    """transformers' load_gguf_checkpoint, its metadata-only calls (return_tensors=False) remembered per file: a
    first start asks once for the config and once more for the tokenizer, and each decodes every field, the whole
    vocabulary included (0.18 s for 128K tokens). Each caller gets its own copy, as from a parse of its own."""
    parsed: dict[str, dict] = {}

    def load_gguf_checkpoint(path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs:
            return parse_metadata(path, return_tensors, *args, **kwargs)
        key = _file_key(path)
        if key not in parsed:
            parsed[key] = parse_metadata(path, return_tensors=False)
        return copy.deepcopy(parsed[key])

    return load_gguf_checkpoint


def _read_header(path: Path) -> tuple[str | None, list[TensorInfo]]:
    try:
        reader = header_reader(path)
    except Exception as exc:  # the reader raises ValueError, IndexError, ... on a cut or foreign file
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    infos = [TensorInfo(t.name, t.tensor_type, tuple(int(n) for n in t.shape), int(t.n_bytes), int(t.data_offset))
             for t in reader.tensors]
    return _string_field(reader, "general.architecture"), infos


def _write_index(index: Path, architecture: str | None, tensors: list[TensorInfo]) -> None:
    rows = [[t.name, int(t.tensor_type), list(t.shape), t.n_bytes, t.data_offset] for t in tensors]
    try:
        index.parent.mkdir(parents=True, exist_ok=True)
        partial = index.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"architecture": architecture, "tensors": rows}))
        partial.replace(index)
    except OSError:
        pass  # a read-only cache: parse again next time


@functools.lru_cache(maxsize=2)
def _open(path: Path, size: int, mtime_ns: int, index: Path | None) -> GgufFile:
    """Once per process and file version: a start asks three times (which loader, the tied head, the weights)."""
    return GgufFile._parse(path, index)


def _unpermuted(raw: torch.Tensor, heads: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """raw's rows in the order undoing llama.cpp's q/k permute (per head, its even rows then its odd ones), as one
    strided copy (a row gather was 7x slower), into `out` (as many bytes) where given."""
    rows = raw.shape[0]
    interleaved = raw.reshape(heads, rows // heads // 2, 2, -1).transpose(1, 2)
    if out is None:
        return interleaved.reshape(raw.shape)
    return out.view(interleaved.shape).copy_(interleaved).view(raw.shape)


def _string_field(reader, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
