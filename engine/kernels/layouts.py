"""The packed weight layouts Tern's CPU kernels read, as pure tensor functions (pack, unpack, row lookup).

Kernels read weights in the order they use them, so a thread streams one sequential run of memory:
- int4: per group of 8 rows and 32 columns, 160 bytes: 128 bytes of nibbles (register j of 32 bytes holds, for
  each row r at bytes 4r..4r+3, columns 8j..8j+3 in the low nibbles and 8j+4..8j+7 in the high ones), then the
  8 rows' fp16 scales d, then their fp16 minimums m. Shape uint8 [N, K * 5 / 8].
- q4 (GGUF's Q4_0: w = d * (q - 8), one fp16 d per 32 values of a row): int4's groups without the minimums,
  144 bytes: the same 128 bytes of nibbles, then the 8 rows' fp16 d. Shape uint8 [N, K * 9 / 16]: a Q4_0 file's
  own 18 bytes per 32 values.
- q4k (GGUF's Q4_K: per super-block of 256 values of a row an fp16 d and dmin, per sub-block j of 32 a 6-bit
  scale s_j and minimum m_j; w = (d * s_j) * q - dmin * m_j): per group of 8 rows and super-block, 1152 bytes:
  the 8 rows' fp16 d, their fp16 dmin, a uint32 per row with the top 2 bits of s_j at bits 2j and of m_j at
  16 + 2j, 64 bytes (s_j & 15) | (m_j & 15) << 4 at byte 8j + row, then the 8 sub-blocks' 128 bytes of nibbles as
  int4 lays them out. Shape uint8 [N, K * 9 / 16]: a Q4_K file's own 144 bytes per 256 values.
- q6k (GGUF's Q6_K: per super-block of 256 values of a row an fp16 d, per sub-block j of 16 an int8 scale s_j;
  w = (d * s_j) * (q - 32), q in 0..63): per group of 8 rows and super-block, 1680 bytes: the 8 rows' fp16 d,
  128 bytes of scales (byte 16 + 8j + row), then per block of 32 columns 192 bytes: q's low 4 bits as int4 lays out
  its nibbles (128 bytes), then two 32-byte registers of top bits: register a's byte 4r + t holds at bits 2k, 2k + 1
  the top 2 bits of the value whose low bits are nibble register 2a + k // 2's byte 4r + t (low nibble for even k,
  high for odd). Shape uint8 [N, K * 105 / 128]: a Q6_K file's own 210 bytes per 256 values.
- q5k (GGUF's Q5_K: Q4_K with a fifth bit per value, w = (d * s_j) * q - dmin * m_j, q in 0..31): per group of 8
  rows and super-block, 1408 bytes: q4k's 128 header bytes, then per sub-block of 32 columns 160 bytes: q's low 4
  bits as int4 lays out its nibbles (128 bytes), then 32 bytes of fifth bits: byte 4r + t holds at bit k that of
  the value in nibble register k's byte 4r + t low nibble, at bit 4 + k that of its high nibble, so that a shift
  and an and/or (one vpternlogd) put a register's fifth bits beside its nibbles. Shape uint8 [N, K * 11 / 16]: a
  Q5_K file's own 176 bytes per 256 values.
- q8 (GGUF's Q8_0: w = d * q, q int8, one fp16 d per 32 values of a row): per group of 8 rows and 32 columns,
  272 bytes: 256 bytes of q + 128 (register j of 32 bytes holds, for each row r at bytes 4r..4r+3, columns
  4j..4j+3), then the 8 rows' fp16 scales d. Shape uint8 [N, K * 17 / 16].
- bf16 (AVX512-BF16): each group of 4 rows stored 64-byte chunk by chunk, [N/4][K/32][4][32].
"""
from __future__ import annotations

import functools

import torch

INT4_GROUP_ROWS, INT4_GROUP_COLS = 8, 32
Q8_GROUP_ROWS, Q8_GROUP_COLS = INT4_GROUP_ROWS, INT4_GROUP_COLS  # the same blocks: one row lookup serves both
BF16_GROUP_ROWS, CHUNK_BYTES = 4, 64


def can_pack_int4(weight: torch.Tensor) -> bool:
    rows, cols = weight.shape
    return weight.device.type == "cpu" and rows % INT4_GROUP_ROWS == 0 and cols % INT4_GROUP_COLS == 0


def can_pack_q8(weight: torch.Tensor) -> bool:
    rows, cols = weight.shape
    return weight.device.type == "cpu" and rows % Q8_GROUP_ROWS == 0 and cols % Q8_GROUP_COLS == 0


def can_pack_bf16(weight: torch.Tensor) -> bool:
    rows, cols = weight.shape
    return weight.device.type == "cpu" and rows % BF16_GROUP_ROWS == 0 and cols % (CHUNK_BYTES // 2) == 0


def pack_int4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] in 0..15, d and m fp16 [N, K/32] (w = d * q + m) -> uint8 [N, K * 5 / 8]."""
    return _pack_nibbles(q, d, m)


def unpack_int4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `pack_int4`: (q uint8 [N, K], d fp16 [N, K/32], m fp16 [N, K/32])."""
    return _unpack_nibbles(packed, 2)


def pack_q4(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] in 0..15, d fp16 [N, K/32] (w = d * (q - 8)) -> uint8 [N, K * 9 / 16]."""
    return _pack_nibbles(q, d)


def unpack_q4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack_q4`: (q uint8 [N, K] in 0..15, d fp16 [N, K/32])."""
    return _unpack_nibbles(packed, 1)


def q4_as_int4(packed: torch.Tensor) -> torch.Tensor:
    """A q4 matrix in int4's layout, the same weight: m = -8 d (exact in fp16)."""
    q, d = unpack_q4(packed)
    return pack_int4(q, d, -8 * d)


Q4K_SUPER_COLS, Q4K_SUPER_BYTES = 256, 1152


def pack_q4k(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, d: torch.Tensor,
             dmin: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] in 0..15, scale and minimum [N, K/32] in 0..63, d and dmin fp16 [N, K/256]
    (w = (d * scale) * q - dmin * minimum) -> uint8 [N, K * 9 / 16]."""
    rows, cols = q.shape
    groups, supers = rows // INT4_GROUP_ROWS, cols // Q4K_SUPER_COLS
    nibbles = _nibble_bytes(q).reshape(groups, supers, 8 * 128)
    sc = scale.to(torch.int32).reshape(groups, INT4_GROUP_ROWS, supers, 8)  # [group, row, super, j]
    mn = minimum.to(torch.int32).reshape(groups, INT4_GROUP_ROWS, supers, 8)
    shifts = 2 * torch.arange(8, dtype=torch.int32)
    top = (((sc >> 4) << shifts) | ((mn >> 4) << (16 + shifts))).sum(-1, dtype=torch.int32)  # bits do not overlap
    top = top.transpose(1, 2).contiguous().view(torch.uint8)  # [group, super, 32]
    low = ((sc & 15) | ((mn & 15) << 4)).to(torch.uint8).permute(0, 2, 3, 1).reshape(groups, supers, 64)

    def per_row(s: torch.Tensor) -> torch.Tensor:  # fp16 [N, supers] -> [group, super, 16 bytes]
        return s.to(torch.float16).reshape(groups, INT4_GROUP_ROWS, supers).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat([per_row(d), per_row(dmin), top, low, nibbles], dim=-1).reshape(rows, cols * 9 // 16)


def unpack_q4k(packed: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The inverse of `pack_q4k`: (q uint8 [N, K], scale and minimum uint8 [N, K/32], d and dmin fp16 [N, K/256])."""
    rows, cols = packed.shape[0], packed.shape[1] * 16 // 9
    groups, supers = rows // INT4_GROUP_ROWS, cols // Q4K_SUPER_COLS
    data = packed.reshape(groups, supers, Q4K_SUPER_BYTES)

    def per_row(offset: int) -> torch.Tensor:
        return data[..., offset:offset + 16].contiguous().view(torch.float16).transpose(1, 2).reshape(rows, supers)

    top = data[..., 32:64].contiguous().view(torch.int32).transpose(1, 2)  # [group, row, super]
    shifts = 2 * torch.arange(8, dtype=torch.int32)
    top_scale, top_min = (top.unsqueeze(-1) >> shifts) & 3, (top.unsqueeze(-1) >> (16 + shifts)) & 3
    low = data[..., 64:128].reshape(groups, supers, 8, INT4_GROUP_ROWS).permute(0, 3, 1, 2).to(torch.int32)
    scale = ((low & 15) | (top_scale << 4)).to(torch.uint8).reshape(rows, -1)
    minimum = ((low >> 4) | (top_min << 4)).to(torch.uint8).reshape(rows, -1)
    q = _nibble_values(data[..., 128:].reshape(groups, supers * 8, 128), rows, cols)
    return q, scale, minimum, per_row(0), per_row(16)


def q4k_scales(scale: torch.Tensor, minimum: torch.Tensor, d: torch.Tensor,
               dmin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block of 32's float32 d * scale and -(dmin * minimum), [N, K/32]: exact products, as the kernels and
    gguf's de-quantizer compute them."""
    per_block = lambda s: s.float().repeat_interleave(Q4K_SUPER_COLS // INT4_GROUP_COLS, dim=1)  # noqa: E731
    return per_block(d) * scale.float(), -(per_block(dmin) * minimum.float())


def dequantize_q4k(packed: torch.Tensor) -> torch.Tensor:
    """float32 [N, K]: (d * scale) * q - dmin * minimum, the weight a q4k matrix stands for (gguf's values)."""
    q, *parts = unpack_q4k(packed)
    d, m = q4k_scales(*parts)
    rows, cols = q.shape
    return (q.float().reshape(rows, -1, INT4_GROUP_COLS) * d.unsqueeze(-1) + m.unsqueeze(-1)).reshape(rows, cols)


def q4k_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a `pack_q4k` matrix de-quantized to float32 [*ids.shape, K] (a Q4_K embedding's lookup)."""
    return _block_rows(packed, ids, dequantize_q4k, "q4k")


def q4k_as_int4(packed: torch.Tensor) -> torch.Tensor:
    """A q4k matrix in int4's layout (for aten's int4pack where no kernel serves): d and m rounded to fp16."""
    q, *parts = unpack_q4k(packed)
    d, m = q4k_scales(*parts)
    return pack_int4(q, d.to(torch.float16), m.to(torch.float16))


Q5K_SUPER_BYTES, Q5K_HEADER_BYTES = 1408, 128  # per group of 8 rows and super-block; q4k's header


def pack_q5k(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, d: torch.Tensor,
             dmin: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] in 0..31, scale and minimum [N, K/32] in 0..63, d and dmin fp16 [N, K/256]
    (w = (d * scale) * q - dmin * minimum) -> uint8 [N, K * 11 / 16]: q4k's bytes of the low 4 bits, each
    sub-block's 128 bytes of nibbles followed by its 32 bytes of fifth bits."""
    rows, cols = q.shape
    groups, supers, blocks = rows // INT4_GROUP_ROWS, cols // Q4K_SUPER_COLS, cols // INT4_GROUP_COLS
    q = q.to(torch.uint8)
    q4k = pack_q4k(q & 0x0F, scale, minimum, d, dmin).reshape(groups, supers, Q4K_SUPER_BYTES)
    # [group, row, block, register k, low/high, t] -> byte [group, block, row, t], bit k + 4 * (low/high)
    fifth = (q >> 4).to(torch.int32).reshape(groups, INT4_GROUP_ROWS, blocks, 4, 2, 4)
    shifts = torch.arange(4, dtype=torch.int32).reshape(4, 1) + 4 * torch.arange(2, dtype=torch.int32)  # [k, low/high]
    fifth = (fifth << shifts.reshape(4, 2, 1)).sum((3, 4), dtype=torch.int32).to(torch.uint8).permute(0, 2, 1, 3)
    nibbles = q4k[..., Q5K_HEADER_BYTES:].reshape(groups, supers, 8, 128)
    sub_blocks = torch.cat([nibbles, fifth.reshape(groups, supers, 8, 32)], dim=-1).reshape(groups, supers, -1)
    return torch.cat([q4k[..., :Q5K_HEADER_BYTES], sub_blocks], dim=-1).reshape(rows, cols * 11 // 16)


def unpack_q5k(packed: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The inverse of `pack_q5k`: (q uint8 [N, K] in 0..31, scale and minimum uint8 [N, K/32], d and dmin fp16
    [N, K/256])."""
    rows, cols = packed.shape[0], packed.shape[1] * 16 // 11
    groups, supers, blocks = rows // INT4_GROUP_ROWS, cols // Q4K_SUPER_COLS, cols // INT4_GROUP_COLS
    data = packed.reshape(groups, supers, Q5K_SUPER_BYTES)
    sub_blocks = data[..., Q5K_HEADER_BYTES:].reshape(groups, supers, 8, 160)
    q4k = torch.cat([data[..., :Q5K_HEADER_BYTES], sub_blocks[..., :128].reshape(groups, supers, -1)], dim=-1)
    low, *parts = unpack_q4k(q4k.reshape(rows, cols * 9 // 16))
    fifth = sub_blocks[..., 128:].reshape(groups, blocks, 1, 1, INT4_GROUP_ROWS, 4).to(torch.int32)
    shifts = (torch.arange(4, dtype=torch.int32).reshape(4, 1) + 4 * torch.arange(2, dtype=torch.int32))
    fifth = (fifth >> shifts.reshape(1, 1, 4, 2, 1, 1)) & 1  # [group, block, register k, low/high, row, t]
    fifth = fifth.permute(0, 4, 1, 2, 3, 5).reshape(rows, cols).to(torch.uint8)
    return (low | (fifth << 4), *parts)


def dequantize_q5k(packed: torch.Tensor) -> torch.Tensor:
    """float32 [N, K]: (d * scale) * q - dmin * minimum, the weight a q5k matrix stands for (gguf's values)."""
    q, *parts = unpack_q5k(packed)
    d, m = q4k_scales(*parts)
    rows, cols = q.shape
    return (q.float().reshape(rows, -1, INT4_GROUP_COLS) * d.unsqueeze(-1) + m.unsqueeze(-1)).reshape(rows, cols)


def q5k_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a `pack_q5k` matrix de-quantized to float32 [*ids.shape, K] (a Q5_K embedding's lookup)."""
    return _block_rows(packed, ids, dequantize_q5k, "q5k")


Q6K_SUPER_COLS, Q6K_SUPER_BYTES, Q6K_SUB_COLS = 256, 1680, 16


def pack_q6k(q: torch.Tensor, scale: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] in 0..63, scale int8 [N, K/16], d fp16 [N, K/256] (w = (d * scale) * (q - 32)) -> uint8
    [N, K * 105 / 128]."""
    rows, cols = q.shape
    groups, supers, blocks = rows // INT4_GROUP_ROWS, cols // Q6K_SUPER_COLS, cols // INT4_GROUP_COLS
    q = q.to(torch.uint8)
    nibbles = _nibble_bytes(q & 0x0F)  # [group, block, 128]
    # [group, row, block, a, i % 2, low/high, t] -> byte [group, block, a, row, t]: bits 2k with k = 2 (i % 2) + half
    top = (q >> 4).to(torch.int32).reshape(groups, INT4_GROUP_ROWS, blocks, 2, 4, 4)
    top = (top << (2 * torch.arange(4, dtype=torch.int32)).reshape(4, 1)).sum(-2, dtype=torch.int32).to(torch.uint8)
    top = top.permute(0, 2, 3, 1, 4).reshape(groups, blocks, 64)
    block_bytes = torch.cat([nibbles, top], dim=-1).reshape(groups, supers, 8 * 192)
    per_row_d = d.to(torch.float16).reshape(groups, INT4_GROUP_ROWS, supers).transpose(1, 2).contiguous().view(torch.uint8)
    scales = scale.to(torch.int8).reshape(groups, INT4_GROUP_ROWS, supers, 16).permute(0, 2, 3, 1).contiguous()
    scales = scales.view(torch.uint8).reshape(groups, supers, 128)
    return torch.cat([per_row_d, scales, block_bytes], dim=-1).reshape(rows, cols * 105 // 128)


def unpack_q6k(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `pack_q6k`: (q uint8 [N, K] in 0..63, scale int8 [N, K/16], d fp16 [N, K/256])."""
    rows, cols = packed.shape[0], packed.shape[1] * 128 // 105
    groups, supers, blocks = rows // INT4_GROUP_ROWS, cols // Q6K_SUPER_COLS, cols // INT4_GROUP_COLS
    data = packed.reshape(groups, supers, Q6K_SUPER_BYTES)
    d = data[..., :16].contiguous().view(torch.float16).transpose(1, 2).reshape(rows, supers)
    scale = data[..., 16:144].contiguous().view(torch.int8).reshape(groups, supers, 16, INT4_GROUP_ROWS)
    scale = scale.permute(0, 3, 1, 2).reshape(rows, supers * 16)
    block_bytes = data[..., 144:].reshape(groups, blocks, 192)
    low = _nibble_values(block_bytes[..., :128], rows, cols)
    top = block_bytes[..., 128:].reshape(groups, blocks, 2, INT4_GROUP_ROWS, 4).to(torch.int32)  # [g, block, a, row, t]
    top = (top.unsqueeze(3) >> (2 * torch.arange(4, dtype=torch.int32)).reshape(4, 1, 1)) & 3  # [g, block, a, k, row, t]
    top = top.permute(0, 4, 1, 2, 3, 5).reshape(rows, cols).to(torch.uint8)
    return low | (top << 4), scale, d


def dequantize_q6k(packed: torch.Tensor) -> torch.Tensor:
    """float32 [N, K]: (d * scale) * (q - 32), the weight a q6k matrix stands for (gguf's values, in its order)."""
    q, scale, d = unpack_q6k(packed)
    rows, cols = q.shape
    per_sub = d.float().repeat_interleave(Q6K_SUPER_COLS // Q6K_SUB_COLS, dim=1) * scale.float()  # [N, K/16]
    values = (q.to(torch.int8) - 32).float().reshape(rows, -1, Q6K_SUB_COLS)
    return (per_sub.unsqueeze(-1) * values).reshape(rows, cols)


def q6k_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a `pack_q6k` matrix de-quantized to float32 [*ids.shape, K] (a Q6_K embedding's lookup)."""
    return _block_rows(packed, ids, dequantize_q6k, "q6k")


def _nibble_bytes(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] in 0..15 -> per group of 8 rows and block of 32 columns its 128 bytes of nibbles,
    [groups, blocks, 128]: register j's 32 bytes hold, for row r at 4r..4r+3, columns 8j..8j+3 low, 8j+4..8j+7 high."""
    rows, cols = q.shape
    groups, blocks = rows // INT4_GROUP_ROWS, cols // INT4_GROUP_COLS
    # [group, row, block, register j, low/high, t] -> bytes [group, block, j, row, t]
    q = q.to(torch.uint8).reshape(groups, INT4_GROUP_ROWS, blocks, 4, 2, 4)
    return (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(groups, blocks, 128)


def _nibble_values(nibbles: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The inverse of `_nibble_bytes`: [groups, blocks, 128] -> q uint8 [rows, cols]."""
    groups, blocks = nibbles.shape[:2]
    data = nibbles.reshape(groups, blocks, 4, INT4_GROUP_ROWS, 4)  # [group, block, j, row, t]
    q = torch.stack([data & 0x0F, data >> 4], dim=3)  # [group, block, j, low/high, row, t]
    return q.permute(0, 4, 1, 2, 3, 5).reshape(rows, cols)


def _pack_nibbles(q: torch.Tensor, *scales: torch.Tensor) -> torch.Tensor:
    """Per group of 8 rows and 32 columns: 128 bytes of nibbles, then 16 bytes per fp16 scale of `scales`."""
    rows, cols = q.shape
    groups, blocks = rows // INT4_GROUP_ROWS, cols // INT4_GROUP_COLS
    nibbles = _nibble_bytes(q)
    parts = [s.to(torch.float16).reshape(groups, INT4_GROUP_ROWS, blocks).transpose(1, 2).contiguous()
             .view(torch.uint8) for s in scales]  # [group, block, 16 bytes]
    group_bytes = 128 + 16 * len(scales)
    return torch.cat([nibbles, *parts], dim=-1).reshape(rows, cols * group_bytes // 256)


def _unpack_nibbles(packed: torch.Tensor, num_scales: int) -> tuple[torch.Tensor, ...]:
    group_bytes = 128 + 16 * num_scales
    rows, cols = packed.shape[0], packed.shape[1] * 256 // group_bytes
    groups, blocks = rows // INT4_GROUP_ROWS, cols // INT4_GROUP_COLS
    data = packed.reshape(groups, blocks, group_bytes)
    q = _nibble_values(data[..., :128], rows, cols)

    def scales(offset: int) -> torch.Tensor:
        raw = data[..., offset:offset + 16].contiguous().view(torch.float16)  # [group, block, row]
        return raw.transpose(1, 2).reshape(rows, blocks)

    return (q, *(scales(128 + 16 * i) for i in range(num_scales)))


def dequantize_int4(packed: torch.Tensor) -> torch.Tensor:
    """float32 [N, K]: d * q + m, the weight an int4 matrix stands for."""
    q, d, m = unpack_int4(packed)
    rows, cols = q.shape
    grouped = q.float().reshape(rows, -1, INT4_GROUP_COLS)
    return (grouped * d.float().unsqueeze(-1) + m.float().unsqueeze(-1)).reshape(rows, cols)


def int4_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a `pack_int4` matrix de-quantized to float32 [*ids.shape, K] (a 4-bit embedding's lookup)."""
    return _block_rows(packed, ids, dequantize_int4, "int4")


def dequantize_q4(packed: torch.Tensor) -> torch.Tensor:
    """float32 [N, K]: d * (q - 8), the weight a q4 matrix stands for."""
    q, d = unpack_q4(packed)
    rows, cols = q.shape
    return ((q.float() - 8).reshape(rows, -1, INT4_GROUP_COLS) * d.float().unsqueeze(-1)).reshape(rows, cols)


def q4_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a `pack_q4` matrix de-quantized to float32 [*ids.shape, K] (a Q4_0 embedding's lookup)."""
    return _block_rows(packed, ids, dequantize_q4, "q4")


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q int8 [N, K], d fp16 [N, K/32] (w = d * q) -> uint8 [N, K * 17 / 16]."""
    rows, cols = q.shape
    groups, blocks = rows // Q8_GROUP_ROWS, cols // Q8_GROUP_COLS
    shifted = (q.to(torch.int16) + 128).to(torch.uint8)
    # [group, row, block, register j, t] -> bytes [group, block, j, row, t]
    values = shifted.reshape(groups, Q8_GROUP_ROWS, blocks, 8, 4).permute(0, 2, 3, 1, 4).reshape(groups, blocks, 256)
    scales = d.to(torch.float16).reshape(groups, Q8_GROUP_ROWS, blocks).transpose(1, 2).contiguous().view(torch.uint8)
    return torch.cat([values, scales], dim=-1).reshape(rows, cols * 17 // 16)


def unpack_q8(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack_q8`: (q int8 [N, K], d fp16 [N, K/32])."""
    rows, cols = packed.shape[0], packed.shape[1] * 16 // 17
    groups, blocks = rows // Q8_GROUP_ROWS, cols // Q8_GROUP_COLS
    data = packed.reshape(groups, blocks, 272)
    values = data[..., :256].reshape(groups, blocks, 8, Q8_GROUP_ROWS, 4).permute(0, 3, 1, 2, 4)
    q = _unshift(values.reshape(rows, cols))
    d = data[..., 256:].contiguous().view(torch.float16).transpose(1, 2).reshape(rows, blocks)
    return q, d


def dequantize_q8(packed: torch.Tensor) -> torch.Tensor:
    """float32 [N, K]: d * q, the weight a q8 matrix stands for."""
    q, d = unpack_q8(packed)
    rows, cols = q.shape
    return (q.float().reshape(rows, -1, Q8_GROUP_COLS) * d.float().unsqueeze(-1)).reshape(rows, cols)


def q8_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a `pack_q8` matrix de-quantized to float32 [*ids.shape, K] (a q8 embedding's lookup)."""
    return _block_rows(packed, ids, dequantize_q8, "q8")


# Where each row of a group of 8 keeps its bytes in a block (int4, q4, q8: 32 columns; q4k, q5k, q6k: a super-block
# of 256), as the module's docstring lays them out: (the block's columns, its bytes, its regions). A region
# (start, length, width) is a run of units of 8 * width bytes, row r holding bytes width * r .. width * r + width - 1
# of each unit: a 32-byte register of 4 bytes a row, a 16-byte array of one fp16 a row, 8 bytes of one byte a row.
# Every byte belongs to one row, and a row's values come from its bytes alone, so a lookup can move just its rows.
_ROW_REGIONS = {
    "q8": (Q8_GROUP_COLS, 272, ((0, 256, 4), (256, 16, 2))),
    "q4": (INT4_GROUP_COLS, 144, ((0, 128, 4), (128, 16, 2))),
    "int4": (INT4_GROUP_COLS, 160, ((0, 128, 4), (128, 32, 2))),
    "q4k": (Q4K_SUPER_COLS, Q4K_SUPER_BYTES, ((0, 32, 2), (32, 32, 4), (64, 64, 1), (128, 1024, 4))),
    "q5k": (Q4K_SUPER_COLS, Q5K_SUPER_BYTES, ((0, 32, 2), (32, 32, 4), (64, 64, 1), (Q5K_HEADER_BYTES, 1280, 4))),
    "q6k": (Q6K_SUPER_COLS, Q6K_SUPER_BYTES, ((0, 16, 2), (16, 128, 1), (144, 1536, 4))),
}


@functools.cache
def _row_bytes(layout: str, packed_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets, order): offsets[r] the positions of row r's packed_cols bytes in its group's 8 * packed_cols, in
    the group's order; order the permutation that puts 8 rows' bytes, one row after another, where a group has them."""
    _, block_bytes, regions = _ROW_REGIONS[layout]
    in_block = torch.tensor([[unit + width * r + i for start, length, width in regions
                              for unit in range(start, start + length, 8 * width) for i in range(width)]
                             for r in range(INT4_GROUP_ROWS)])  # [8, block_bytes / 8]
    blocks = INT4_GROUP_ROWS * packed_cols // block_bytes
    offsets = (torch.arange(blocks)[None, :, None] * block_bytes + in_block[:, None, :]).reshape(INT4_GROUP_ROWS, -1)
    return offsets, torch.argsort(offsets.reshape(-1))


def _block_rows(packed: torch.Tensor, ids: torch.Tensor, dequantize, layout: str) -> torch.Tensor:
    """Rows `ids` of a block layout (groups of 8 rows) de-quantized to float32: each id's bytes are gathered, 8 ids'
    into one new group as the layout keeps a group, and those groups de-quantized: one row's work a row, where
    de-quantizing each id's whole group did eight (a 256-token prompt chunk's lookup in a 1B Q4_0 file's Q6_K
    embedding, 49152 x 2048: 2.1 ms against 17.6; 16 decode rows 0.25 against 0.61)."""
    packed_cols = packed.shape[1]
    flat = ids.reshape(-1)
    count = flat.numel()
    if count == 0:
        block_cols, block_bytes, _ = _ROW_REGIONS[layout]
        return torch.empty(*ids.shape, INT4_GROUP_ROWS * packed_cols // block_bytes * block_cols)
    padded = torch.cat([flat, flat.new_zeros(-count % INT4_GROUP_ROWS)])  # rows of 0 fill the last group
    offsets, order = _row_bytes(layout, packed_cols)
    group_bytes = INT4_GROUP_ROWS * packed_cols
    starts = (padded // INT4_GROUP_ROWS) * group_bytes
    own = packed.reshape(-1)[starts[:, None] + offsets[padded % INT4_GROUP_ROWS]]  # [padded, packed_cols]
    regrouped = own.reshape(padded.numel() // INT4_GROUP_ROWS, group_bytes)[:, order]
    values = dequantize(regrouped.reshape(padded.numel(), packed_cols))[:count]
    return values.reshape(*ids.shape, -1)


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the bf16 kernel's layout, same dtype and shape: each group of 4 rows stored 64-byte chunk by chunk."""
    return _interleave(weight, BF16_GROUP_ROWS, CHUNK_BYTES // weight.element_size())


def unpack_bf16(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_bf16`: [N, K] in row order."""
    return _deinterleave(packed, BF16_GROUP_ROWS, CHUNK_BYTES // packed.element_size())


def bf16_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a `pack_bf16` matrix as [*ids.shape, K] (a tied embedding's lookup), without unpacking it."""
    return _gather(packed, ids, BF16_GROUP_ROWS, CHUNK_BYTES // packed.element_size())


def _interleave(weight: torch.Tensor, group_rows: int, chunk: int) -> torch.Tensor:
    """[N, K] stored as [N/group_rows][K/chunk][group_rows][chunk] (same shape and dtype)."""
    rows, cols = weight.shape
    grouped = weight.reshape(rows // group_rows, group_rows, cols // chunk, chunk)
    return grouped.permute(0, 2, 1, 3).contiguous().reshape(rows, cols)


def _deinterleave(packed: torch.Tensor, group_rows: int, chunk: int) -> torch.Tensor:
    rows, cols = packed.shape
    grouped = packed.reshape(rows // group_rows, cols // chunk, group_rows, chunk).permute(0, 2, 1, 3)
    return grouped.reshape(rows, cols)


def _gather(packed: torch.Tensor, ids: torch.Tensor, group_rows: int, chunk: int) -> torch.Tensor:
    rows, cols = packed.shape
    grouped = packed.view(rows // group_rows, cols // chunk, group_rows, chunk)
    picked = grouped[ids // group_rows, :, ids % group_rows, :]  # [*ids.shape, K/chunk, chunk]
    return picked.reshape(*ids.shape, cols)


def _unshift(shifted: torch.Tensor) -> torch.Tensor:
    return (shifted ^ 0x80).view(torch.int8)  # stored as w + 128 (mod 256): flipping the top bit gives w
