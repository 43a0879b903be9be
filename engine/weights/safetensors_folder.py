"""A Hugging Face checkpoint folder's safetensors files as a weight source for engine/weights/streamed_load.py: tensors are
read one at a time, a few thousand rows at a time for the big ones, so an 8B bf16 folder (16 GB) is quantized into
int8 or int4 without ever being in memory whole, let alone in float32.

The files are read with plain reads into memory of the loader's own, not through safetensors' `safe_open`: that maps
each file, and every page a read touches stays in the process's resident set until the mapping closes at the end of
the load. An 8B bf16 folder served as int8 peaked at 18.0 GB resident that way (7.5 GB of weights, the 1 GiB KV
pool and ~9 GB of the files' pages) where the weights, the largest tensor in float32 and the pool are 9.3 GB. The
format is an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape and byte range after the
header) and the data (https://github.com/huggingface/safetensors#format)."""
from __future__ import annotations

import contextlib
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import ModelLoadError
from engine.kernels.dispatch import GGUF_REPACK_LAYOUTS
from engine.weights import quant
from engine.weights.gguf_file import REPACKED_FLOATS

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
_REPACKED_TYPE_IDS = {t.name: int(t) for t in REPACKED_FLOATS}  # a header's dtype name -> its ggml type id
_ROWS_PER_READ = 4096  # rows of a big tensor read (and quantized) at a time: a multiple of q8's groups of 8 rows


@dataclass(frozen=True)
class _Tensor:
    file: Path
    dtype_name: str  # the header's, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # the data's first byte in the file

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype_name]

    def read_rows(self, first: int, stop: int) -> torch.Tensor:
        """Rows first..stop-1 (along dim 0), read from the file into a tensor of their own."""
        row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize
        out = torch.empty((stop - first) * row_bytes, dtype=torch.uint8)
        view = memoryview(out.numpy())
        with open(self.file, "rb") as file:
            file.seek(self.start + first * row_bytes)
            done = 0
            while done < len(view):
                got = file.readinto(view[done:])
                if not got:
                    raise ModelLoadError(f"{self.file}: truncated while reading a tensor")
                done += got
        return out.view(self.dtype).reshape(stop - first, *self.shape[1:])

    def read(self) -> torch.Tensor:
        if not self.shape:  # a scalar: one "row" of one value
            return self.read_rows(0, 1).reshape(())
        return self.read_rows(0, self.shape[0])


def _read_header(file: Path) -> dict[str, _Tensor]:
    """The tensors of one safetensors file, checked against its size before anything is read from its data."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > min(_MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(handle.read(length))
        tensors, base = {}, 8 + length
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            if dtype not in _DTYPES:
                raise ValueError(f"tensor {name} has dtype {dtype}, which Tern does not read")
            if end - begin != math.prod(shape) * _DTYPES[dtype].itemsize or base + end > size:
                raise ValueError(f"tensor {name}'s bytes {begin}..{end} do not fit its shape or the file")
            tensors[name] = _Tensor(file, dtype, shape, base + begin)
    except (struct.error, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{file}: not a readable safetensors file ({exc})") from None
    return tensors


class SafetensorsFolder:
    def __init__(self, folder: Path) -> None:
        self.path = folder
        self._tensors: dict[str, _Tensor] = {}
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"no weights (*.safetensors) in {folder}")
        for file in files:
            for name, tensor in _read_header(file).items():
                self._tensors[name.removeprefix("module.")] = tensor

    def names(self) -> list[str]:
        return list(self._tensors)

    def reading(self):
        """Nothing to set up: each read is a tensor's rows into memory of its own."""
        return contextlib.nullcontext(self)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self._tensors[name].shape

    def type_name(self, name: str) -> str:
        return self._tensors[name].dtype_name

    def layout(self, name: str) -> str | None:
        return None  # float checkpoints: the mode quantizes them (engine/weights/quant.py)

    def packed(self, name: str, num_heads: int | None = None, repack=None, out: torch.Tensor | None = None) -> torch.Tensor:
        raise ValueError(f"{name} is a float tensor in {self.path}")

    def q8(self, name: str, num_heads: int | None = None, repack=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The matrix quantized into layouts.pack_q8's bytes (quant.pack_q8), by _quantized."""
        return self._quantized(name, "q8", repack, out)

    def int4(self, name: str, num_heads: int | None = None, repack=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The matrix quantized into layouts.pack_int4's bytes (quant.quantize_int4), by _quantized."""
        return self._quantized(name, "int4", repack, out)

    def _quantized(self, name: str, layout: str, repack, out: torch.Tensor | None) -> torch.Tensor:
        """The matrix in `layout` ("q8" or "int4"), a few thousand rows at a time (into `out` if given): by the kernel
        library's `repack` (CpuKernels.gguf_repack, which quantizes GGUF's F32, F16 and BF16 rows, the same bytes as
        a safetensors file's, exactly as quant.pack_q8 and quant.quantize_int4 do) in one pass where given, else
        through float32. An 8B bf16 folder on a 2-core Intel VM, through float32: into int8 136 s, into int4 161 s."""
        tensor = self._tensors[name]
        rows = tensor.shape[0]
        if repack is not None and tensor.dtype_name in _REPACKED_TYPE_IDS and len(tensor.shape) == 2:
            type_id, cols = _REPACKED_TYPE_IDS[tensor.dtype_name], tensor.shape[1]

            def pack(start: int, stop: int, into: torch.Tensor | None) -> torch.Tensor:
                raw = tensor.read_rows(start, stop).view(torch.uint8)
                return repack(raw, type_id, cols, GGUF_REPACK_LAYOUTS[layout], into)
        else:
            def pack(start: int, stop: int, into: torch.Tensor | None) -> torch.Tensor:
                packed = quant.PACK_FROM_FLOAT[layout](tensor.read_rows(start, stop).to(torch.float32))
                return packed if into is None else into.copy_(packed)
        chunks = [pack(start, min(start + _ROWS_PER_READ, rows),
                       None if out is None else out[start:start + _ROWS_PER_READ])
                  for start in range(0, rows, _ROWS_PER_READ)]
        return out if out is not None else torch.cat(chunks)

    def float(self, name: str, num_heads: int | None = None) -> torch.Tensor:
        """float32, in memory of its own (not the file's mapping); rows already in transformers' order."""
        return self._tensors[name].read().to(torch.float32)

    def float_rows(self, name: str, num_heads: int | None = None, rows: int = _ROWS_PER_READ):
        tensor = self._tensors[name]
        total = tensor.shape[0]
        for start in range(0, total, rows):
            yield tensor.read_rows(start, min(start + rows, total)).to(torch.float32)
