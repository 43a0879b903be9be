"""A Hugging Face checkpoint folder's safetensors files as a weight source for engine/weights/streamed_load.py: tensors are
read one at a time, a few thousand rows at a time for the big ones, so an 8B bf16 folder (16 GB) is quantized into
int8 or int4 without ever being in memory whole, let alone in float32."""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from engine.weights import quant
from engine.errors import ModelLoadError


class SafetensorsFolder:
    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self.path = folder
        self._files = {}  # tensor name -> the open file holding it
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"no weights (*.safetensors) in {folder}")
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as exc:  # safetensors raises its own error types for cut or foreign files
                raise ModelLoadError(f"{file}: not a readable safetensors file ({exc})") from None
            for name in handle.keys():
                self._files[name.removeprefix("module.")] = (handle, name)

    def names(self) -> list[str]:
        return list(self._files)

    def reading(self):
        """Nothing to set up: safetensors reads each slice into memory of its own."""
        return contextlib.nullcontext(self)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def shape(self, name: str) -> tuple[int, ...]:
        handle, key = self._files[name]
        return tuple(handle.get_slice(key).get_shape())

    def type_name(self, name: str) -> str:
        handle, key = self._files[name]
        return handle.get_slice(key).get_dtype()

    def layout(self, name: str) -> str | None:
        return None  # float checkpoints: the mode quantizes them (engine/weights/quant.py)

    def packed(self, name: str, num_heads: int | None = None, repack=None, out: torch.Tensor | None = None) -> torch.Tensor:
        raise ValueError(f"{name} is a float tensor in {self.path}")

    def q8(self, name: str, num_heads: int | None = None, repack=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The matrix quantized into layouts.pack_q8's bytes, a few thousand rows at a time (into `out` if given)."""
        if out is None:
            return torch.cat([quant.pack_q8(rows) for rows in self.float_rows(name)])
        start = 0
        for rows in self.float_rows(name):
            out[start:start + rows.shape[0]] = quant.pack_q8(rows)
            start += rows.shape[0]
        return out

    def float(self, name: str, num_heads: int | None = None) -> torch.Tensor:
        """float32, in memory of its own (not the file's mapping); rows already in transformers' order."""
        handle, key = self._files[name]
        return handle.get_tensor(key).to(torch.float32, copy=True)

    def float_rows(self, name: str, num_heads: int | None = None, rows: int = 4096):
        handle, key = self._files[name]
        tensor = handle.get_slice(key)
        total = tensor.get_shape()[0]
        for start in range(0, total, rows):
            yield tensor[start:start + rows].to(torch.float32)
