"""What each GGUF tensor type becomes in Tern, and the repacking of quantized blocks into Tern's layouts.

`GGUF_TYPES` is the one table: per ggml type, the layout that serves it and how exact that is. Adding a type is one
entry here plus its repacking (or kernel). The block layouts are llama.cpp's (ggml-common.h), as the `gguf`
package's reference de-quantizers read them; the tests hold every repacking to those references.

- `q4` (layouts.pack_q4: per 32 values of a row, w = d * (q - 8) with fp16 d): Q4_0, exact, in the file's own
  18 bytes per 32 values. Where a fused projection joins it to int4 parts, Q4_0 goes into int4 instead (`int4`
  below: m = -8 d, exact).
- `q4k` (layouts.pack_q4k: per super-block of 256 values of a row fp16 d and dmin, per 32 a 6-bit scale and
  minimum): Q4_K, exact, in the file's own 144 bytes per 256 values, where the kernel path has a q4k kernel
  (AVX512); its kernels multiply as llama.cpp's Q4_K x Q8_K does (activations in blocks of 256, the scales and
  minimums applied in integers). Elsewhere Q4_K goes into int4 (below).
- `int4` (Tern's 4-bit layout, layouts.pack_int4: per 32 values of a row, w = d * q + m with fp16 d and m):
  Q4_1 (exact); Q4_K where no q4k kernel serves it, or where a fused projection joins it to Q4_0 or Q4_1 parts:
  per sub-block of 32 as d = super_d * scale and m = -super_dmin * min, both products rounded to fp16.
- `q5k` (layouts.pack_q5k: Q4_K's super-block with a fifth bit per value): Q5_K, exact, in the file's own
  176 bytes per 256 values, where the kernel path has a q5k kernel (AVX2 and AVX512); its kernels multiply as
  llama.cpp's Q5_K x Q8_K (q4k's arithmetic on 5-bit values). Elsewhere (the `off` path), and where a fused
  projection joins it to parts of another type, Q5_K is de-quantized and goes into q8 (`dequantize` below).
- `q6k` (layouts.pack_q6k: per super-block of 256 values of a row an fp16 d, per 16 an int8 scale): Q6_K, exact,
  in the file's own 210 bytes per 256 values, where the kernel path has a q6k kernel (AVX2 and AVX512); its kernels
  multiply as llama.cpp's Q6_K x Q8_K. Elsewhere (the `off` path), and where a fused projection joins it to parts
  of another type, Q6_K is de-quantized and goes into q8 (`dequantize` below).
- `q8` (Tern's 8-bit layout, layouts.pack_q8: per 32 values of a row, w = d * q with q int8 and fp16 d): Q8_0,
  exact (the same block, its bytes reordered); Q5_0, exact (w = d * (q - 16): q - 16 is an int8 level under the
  file's own d). Q4_0 goes into q8 exactly the same way where a fused projection joins it to q8 parts.
- `dequantize`: read as float32 one tensor at a time with `gguf`'s own reference, then handled as a checkpoint's
  float weight is (norms, biases; a linear layer gets the mode's quantization: under `auto` and `int8` q8,
  re-quantized per 32 values, quant.quantize_q8). F32, F16, BF16 are exact this way; Q5_1, and Q5_K and Q6_K where
  no q5k or q6k kernel serves them (5 or 6 bits with a minimum or nested scales), round to the nearest of q8's 255
  levels per 32 values: an error of at most half a step of absmax / 127, a fraction of their own step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from engine.kernels import layouts

Int4Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q uint8 [N, K] in 0..15, d fp16 [N, K/32], m fp16
Q8Parts = tuple[torch.Tensor, torch.Tensor]  # q int8 [N, K], d fp16 [N, K/32]


@dataclass(frozen=True)
class GgufType:
    layout: str  # "int4", "q4", "q4k", "q5k", "q6k", "q8" or "dequantize"
    repack: Callable[[torch.Tensor], torch.Tensor] | None = None  # uint8 [rows, bytes per row] -> the layout's bytes
    plain: Callable[[torch.Tensor], tuple] | None = None  # the same as the layout's parts: the twin tests hold it to
    int4: Callable[[torch.Tensor], torch.Tensor] | None = None  # a q4 type's blocks into int4 (a fused layer's parts)
    q8: Callable[[torch.Tensor], torch.Tensor] | None = None  # into q8 exactly, for a type served in another layout

    def holds(self, layout: str) -> bool:
        """Whether the type's values go into `layout` exactly, by repacking its blocks."""
        return (layout == self.layout and self.repack is not None) or self._other(layout) is not None

    def repack_into(self, layout: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """The torch repacking into `layout`: the type's own, or another one it goes into exactly."""
        if layout == self.layout and self.repack is not None:
            return self.repack
        if self._other(layout) is not None:
            return self._other(layout)
        raise ValueError(f"no repacking of {self.layout} blocks into {layout}")

    def _other(self, layout: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return {"int4": self.int4, "q8": self.q8}.get(layout)


def _split(blocks: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """uint8 [rows, bytes per row] -> [rows, blocks per row, block_bytes]."""
    rows = blocks.shape[0]
    return blocks.reshape(rows, -1, block_bytes)


def _fp16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from its 2 bytes, the last dimension: [..., 2] uint8 -> [...] fp16."""
    return raw.contiguous().view(torch.float16).squeeze(-1)


def _low_high(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: the n low nibbles, then the n high ones (ggml's order within a block of 32)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def q4_0_to_int4(blocks: torch.Tensor) -> Int4Parts:
    """Q4_0: 18 bytes per 32 values, fp16 d then 16 bytes of nibbles; w = d * (q - 8) = d * q + (-8 d), exactly
    (8 d is exact in fp16 and both products are exact in fp32)."""
    b = _split(blocks, 18)
    d = _fp16(b[..., 0:2])
    q = _low_high(b[..., 2:18])
    return q.reshape(blocks.shape[0], -1), d, (-8 * d.float()).to(torch.float16)


def q4_0_to_q4(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0: 18 bytes per 32 values, fp16 d then 16 bytes of nibbles; w = d * (q - 8): Tern's q4 as it is."""
    b = _split(blocks, 18)
    return _low_high(b[..., 2:18]).reshape(blocks.shape[0], -1), _fp16(b[..., 0:2])


def q4_0_to_q8(blocks: torch.Tensor) -> Q8Parts:
    """Q4_0 into q8 exactly: q - 8 in -8..7 is an int8 level under the same fp16 d."""
    q, d = q4_0_to_q4(blocks)
    return q.to(torch.int8) - 8, d


def q5_0_to_q8(blocks: torch.Tensor) -> Q8Parts:
    """Q5_0: 22 bytes per 32 values, fp16 d, 32 fifth bits (bit i: value i's), 16 bytes of nibbles (as Q4_0's);
    w = d * (q - 16), and q - 16 in -16..15 is an int8 level under the same d: Tern's q8 holds it exactly."""
    b = _split(blocks, 22)
    fifth = (_int32(b[..., 2:6]) >> torch.arange(32, dtype=torch.int32)) & 1  # [rows, blocks, 32]
    q = _low_high(b[..., 6:22]).to(torch.int32) | (fifth << 4)
    return (q - 16).to(torch.int8).reshape(blocks.shape[0], -1), _fp16(b[..., 0:2])


def q4_1_to_int4(blocks: torch.Tensor) -> Int4Parts:
    """Q4_1: 20 bytes per 32 values, fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m: Tern's int4 as it is."""
    b = _split(blocks, 20)
    q = _low_high(b[..., 4:20])
    return q.reshape(blocks.shape[0], -1), _fp16(b[..., 0:2]), _fp16(b[..., 2:4])


def q4_k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and 8 six-bit minimums packed in a K-quant super-block's 12 bytes: [..., 12] ->
    ([..., 8], [..., 8]) as int32. Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7,
    bytes 4-7 the same for the minimums, bytes 8-11 the low 4 bits of scales 4-7 and (high nibble) minimums 4-7."""
    s = scales.to(torch.int32)
    first, second, last = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([first & 0x3F, (last & 0x0F) | ((first >> 2) & 0x30)], dim=-1)
    mn = torch.cat([second & 0x3F, (last >> 4) | ((second >> 2) & 0x30)], dim=-1)
    return sc, mn


def q4_k_to_q4k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q4_K: 144 bytes per 256 values: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and minimums, 128 bytes of
    nibbles (each 32 bytes hold sub-block 2c in the low nibbles and 2c+1 in the high ones); per sub-block j of 32,
    w = (d * scale_j) * q - (dmin * min_j): Tern's q4k as it is, (q [N, K], scale and min uint8 [N, K/32], d and
    dmin fp16 [N, K/256])."""
    b = _split(blocks, 144)
    rows = blocks.shape[0]
    sc, mn = q4_k_scales_mins(b[..., 4:16])
    qs = b[..., 16:144].reshape(*b.shape[:2], 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=3)  # [rows, super-blocks, chunk, low/high, 32]: sub-block 2c + h
    return (q.reshape(rows, -1), sc.to(torch.uint8).reshape(rows, -1), mn.to(torch.uint8).reshape(rows, -1),
            _fp16(b[..., 0:2]), _fp16(b[..., 2:4]))


def q4_k_packed_q4k(blocks: torch.Tensor) -> torch.Tensor:
    return layouts.pack_q4k(*q4_k_to_q4k(blocks))


def q4_k_to_int4(blocks: torch.Tensor) -> Int4Parts:
    """Q4_K: 144 bytes per 256 values: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and minimums, 128 bytes of
    nibbles (each 32 bytes hold sub-block 2c in the low nibbles and 2c+1 in the high ones); per sub-block of 32,
    w = (d * scale) * q - (dmin * min). Tern's int4 stores d * scale and -(dmin * min) in fp16."""
    b = _split(blocks, 144)
    d, dmin = _fp16(b[..., 0:2]).float(), _fp16(b[..., 2:4]).float()
    sc, mn = q4_k_scales_mins(b[..., 4:16])
    qs = b[..., 16:144].reshape(*b.shape[:2], 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=3)  # [rows, super-blocks, chunk, low/high, 32]: sub-block 2c + h
    scale = (d.unsqueeze(-1) * sc.float()).to(torch.float16)
    minimum = (-(dmin.unsqueeze(-1) * mn.float())).to(torch.float16)
    rows = blocks.shape[0]
    return q.reshape(rows, -1), scale.reshape(rows, -1), minimum.reshape(rows, -1)


# Fast repacking, the table's: the same bytes as layouts.pack_int4 of the functions above (their plain twins, which
# the tests hold to gguf's de-quantizers and these to them), built from whole 32-bit words of nibbles instead of
# one value per byte: ~4x faster, which is seconds of a 1B model's start.
LOW_NIBBLES = 0x0F0F0F0F


def _words_from_low_high(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes holding values 0..15 in their low nibbles and 16..31 in their high ones (Q4_0, Q4_1), as int32
    [..., 4] -> Tern's 4 register words [..., 4]: word j holds values 8j..8j+3 low and 8j+4..8j+7 high."""
    b0, b1, b2, b3 = qs.unbind(-1)
    return torch.stack([(b0 & LOW_NIBBLES) | ((b1 & LOW_NIBBLES) << 4), (b2 & LOW_NIBBLES) | ((b3 & LOW_NIBBLES) << 4),
                        ((b0 >> 4) & LOW_NIBBLES) | (b1 & ~LOW_NIBBLES), ((b2 >> 4) & LOW_NIBBLES) | (b3 & ~LOW_NIBBLES)],
                       dim=-1)


def _words_from_32_bytes(quads: torch.Tensor, high: bool) -> torch.Tensor:
    """32 bytes holding values 0..31 in their low (or high) nibbles (a K-quant sub-block), as int32 [..., 8] ->
    Tern's 4 register words [..., 4]."""
    first, second = quads[..., 0::2], quads[..., 1::2]  # bytes 8j..8j+3 and 8j+4..8j+7
    if high:
        return ((first >> 4) & LOW_NIBBLES) | (second & ~LOW_NIBBLES)
    return (first & LOW_NIBBLES) | ((second & LOW_NIBBLES) << 4)


def _pack_words(words: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    """Register words int32 [N, blocks, 4], d and m fp16 [N, blocks] -> layouts.pack_int4's uint8 [N, K * 5 / 8];
    without m, layouts.pack_q4's uint8 [N, K * 9 / 16]."""
    rows, blocks = d.shape
    groups = rows // layouts.INT4_GROUP_ROWS
    nibbles = words.reshape(groups, layouts.INT4_GROUP_ROWS, blocks, 4).permute(0, 2, 3, 1)
    scales = [s.reshape(groups, layouts.INT4_GROUP_ROWS, blocks).transpose(1, 2).contiguous().view(torch.int32)
              for s in (d, m) if s is not None]  # [group, block, 4 words = 8 fp16]
    packed = torch.cat([nibbles.reshape(groups, blocks, 32), *scales], dim=-1)  # 40 words (160 bytes), or 36
    return packed.view(torch.uint8).reshape(rows, -1)


def _int32(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.int32)


def q4_0_packed(blocks: torch.Tensor) -> torch.Tensor:
    b = _split(blocks, 18)
    d = _fp16(b[..., 0:2])
    return _pack_words(_words_from_low_high(_int32(b[..., 2:18])), d, (-8 * d.float()).to(torch.float16))


def q4_0_packed_q4(blocks: torch.Tensor) -> torch.Tensor:
    b = _split(blocks, 18)
    return _pack_words(_words_from_low_high(_int32(b[..., 2:18])), _fp16(b[..., 0:2]))


def q4_1_packed(blocks: torch.Tensor) -> torch.Tensor:
    b = _split(blocks, 20)
    return _pack_words(_words_from_low_high(_int32(b[..., 4:20])), _fp16(b[..., 0:2]), _fp16(b[..., 2:4]))


def q4_k_packed(blocks: torch.Tensor) -> torch.Tensor:
    b = _split(blocks, 144)
    rows, supers = b.shape[:2]
    d, dmin = _fp16(b[..., 0:2]).float(), _fp16(b[..., 2:4]).float()
    sc, mn = q4_k_scales_mins(b[..., 4:16])
    quads = _int32(b[..., 16:144]).reshape(rows, supers, 4, 8)  # 4 chunks of 32 bytes: sub-blocks 2c and 2c + 1
    words = torch.stack([_words_from_32_bytes(quads, high=False), _words_from_32_bytes(quads, high=True)], dim=3)
    scale = (d.unsqueeze(-1) * sc.float()).to(torch.float16).reshape(rows, -1)
    minimum = (-(dmin.unsqueeze(-1) * mn.float())).to(torch.float16).reshape(rows, -1)
    return _pack_words(words.reshape(rows, supers * 8, 4), scale, minimum)


def q5_k_to_q5k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q5_K: 176 bytes per 256 values: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and minimums (as Q4_K's), 32
    bytes qh of fifth bits, 128 bytes of nibbles (as Q4_K's); per sub-block j of 32, w = (d * scale_j) * q -
    (dmin * min_j) with q in 0..31: Tern's q5k as it is, (q [N, K], scale and min uint8 [N, K/32], d and dmin fp16
    [N, K/256]). Value l of sub-block j has its fifth bit at qh[l]'s bit j."""
    b = _split(blocks, 176)
    rows, supers = b.shape[:2]
    sc, mn = q4_k_scales_mins(b[..., 4:16])
    qh = b[..., 16:48].reshape(rows, supers, 1, 32)
    qs = b[..., 48:176].reshape(rows, supers, 4, 32)
    low = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(rows, supers, 8, 32)  # sub-block 2c + h
    fifth = (qh >> torch.arange(8, dtype=torch.uint8).reshape(8, 1)) & 1  # [rows, supers, j, 32]
    return ((low | (fifth << 4)).reshape(rows, -1), sc.to(torch.uint8).reshape(rows, -1),
            mn.to(torch.uint8).reshape(rows, -1), _fp16(b[..., 0:2]), _fp16(b[..., 2:4]))


def q5_k_packed_q5k(blocks: torch.Tensor) -> torch.Tensor:
    return layouts.pack_q5k(*q5_k_to_q5k(blocks))


def q6_k_to_q6k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K: 210 bytes per 256 values: 128 bytes of low nibbles, 64 of top 2 bits, 16 int8 scales, fp16 d; per
    sub-block j of 16, w = (d * scale_j) * (q - 32): Tern's q6k as it is, (q uint8 [N, K] in 0..63, scale int8
    [N, K/16], d fp16 [N, K/256]). Per half of 128 values, value v's low bits are ql[v % 64]'s nibble v // 64 and
    its top bits qh[v % 32]'s bits 2 (v // 32)."""
    b = _split(blocks, 210)
    rows, supers = b.shape[:2]
    ql = b[..., :128].reshape(rows, supers, 2, 64)
    qh = b[..., 128:192].reshape(rows, supers, 2, 1, 32)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=-1)  # [rows, supers, half, 128]
    top = ((qh >> (2 * torch.arange(4, dtype=torch.uint8)).reshape(4, 1)) & 3).reshape(rows, supers, 2, 128)
    q = (low | (top << 4)).reshape(rows, -1)
    scale = b[..., 192:208].contiguous().view(torch.int8).reshape(rows, -1)
    return q, scale, _fp16(b[..., 208:210])


def q6_k_packed_q6k(blocks: torch.Tensor) -> torch.Tensor:
    return layouts.pack_q6k(*q6_k_to_q6k(blocks))


def q8_0_to_q8(blocks: torch.Tensor) -> Q8Parts:
    """Q8_0: 34 bytes per 32 values, fp16 d then 32 int8 q; w = d * q: Tern's q8 as it is."""
    b = _split(blocks, 34)
    return b[..., 2:34].contiguous().view(torch.int8).reshape(blocks.shape[0], -1), _fp16(b[..., 0:2])


def q8_0_packed(blocks: torch.Tensor) -> torch.Tensor:
    return layouts.pack_q8(*q8_0_to_q8(blocks))


def q4_0_packed_q8(blocks: torch.Tensor) -> torch.Tensor:
    return layouts.pack_q8(*q4_0_to_q8(blocks))


def q5_0_packed(blocks: torch.Tensor) -> torch.Tensor:
    return layouts.pack_q8(*q5_0_to_q8(blocks))


GGUF_TYPES: dict[T, GgufType] = {
    T.F32: GgufType("dequantize"),
    T.F16: GgufType("dequantize"),
    T.BF16: GgufType("dequantize"),
    T.Q4_0: GgufType("q4", q4_0_packed_q4, q4_0_to_q4, int4=q4_0_packed, q8=q4_0_packed_q8),
    T.Q4_1: GgufType("int4", q4_1_packed, q4_1_to_int4),
    T.Q4_K: GgufType("q4k", q4_k_packed_q4k, q4_k_to_q4k, int4=q4_k_packed),
    T.Q5_0: GgufType("q8", q5_0_packed, q5_0_to_q8),
    T.Q5_1: GgufType("dequantize"),
    T.Q8_0: GgufType("q8", q8_0_packed, q8_0_to_q8),
    T.Q5_K: GgufType("q5k", q5_k_packed_q5k, q5_k_to_q5k),
    T.Q6_K: GgufType("q6k", q6_k_packed_q6k, q6_k_to_q6k),
}


def supported_names() -> str:
    return ", ".join(t.name for t in GGUF_TYPES)


def dequantize(raw: np.ndarray, ggml_type: T, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 [shape] from a tensor's raw bytes, with `gguf`'s reference de-quantizer (exact for float types)."""
    from gguf import quants

    values = quants.dequantize(raw.reshape(shape[0], -1) if len(shape) > 1 else raw, ggml_type)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)
