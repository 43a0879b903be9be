"""The arithmetic of Tern's CPU kernels in plain PyTorch: slow, and the specification the tests hold every
instruction set's kernel to, bit for bit (engine/kernels/csrc/kernels.h describes the same steps)."""
from __future__ import annotations

import torch


def quantize_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K/block, block], float32 scales [M, K/block]), rounded as the kernels round."""
    rows, cols = x.shape
    values = x.float().reshape(rows, cols // block, block)
    absmax = values.abs().amax(dim=-1)
    # Tensor by tensor: `127.0 / t` is computed as reciprocal(t) * 127, which rounds twice.
    limit = torch.full_like(absmax, 127.0)
    inverse = torch.where(absmax > 0, limit / absmax, torch.zeros_like(absmax))
    quantized = torch.round(values * inverse.unsqueeze(-1)).to(torch.int8)  # half to even, as the kernels
    return quantized, (absmax / limit).contiguous()


def int4_matmul(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [M, K] times the 4-bit weight d * q + m (q [N, K] in 0..15, d and m fp16 [N, K/32]): [M, N] in x's dtype."""
    quantized, x_scales = quantize_activations(x, 32)
    rows, blocks, _ = quantized.shape
    sums = quantized.long().sum(-1).float()  # [M, K/32]
    d, m = d.float(), m.float()
    acc = torch.zeros(rows, q.shape[0])
    for c in range(blocks):
        dot = quantized[:, c].long() @ q[:, c * 32:(c + 1) * 32].long().t()  # [M, N], exact
        x_scale = x_scales[:, c:c + 1]
        acc = acc + dot.float() * (d[:, c][None] * x_scale)
        acc = acc + m[:, c][None] * (x_scale * sums[:, c:c + 1])
    return acc.to(x.dtype)


def q8_matmul(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [M, K] times the weight d * q (q int8 [N, K], d fp16 [N, K/32]): [M, N] in x's dtype."""
    quantized, x_scales = quantize_activations(x, 32)
    rows, blocks, _ = quantized.shape
    d = d.float()
    acc = torch.zeros(rows, q.shape[0])
    for c in range(blocks):
        dot = quantized[:, c].long() @ q[:, c * 32:(c + 1) * 32].long().t()  # [M, N], exact
        acc = acc + dot.float() * (d[:, c][None] * x_scales[:, c:c + 1])
    return acc.to(x.dtype)


def q4_matmul(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [M, K] times the weight d * (q - 8) (q [N, K] in 0..15, d fp16 [N, K/32]): q8's arithmetic on q - 8, the
    exact integer sum((q - 8) * xq) per block, then one float step."""
    return q8_matmul(x, q.to(torch.int8) - 8, d)



def q4k_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, d: torch.Tensor,
               dmin: torch.Tensor) -> torch.Tensor:
    """x [M, K] times GGUF's Q4_K weight (d * scale) * q - dmin * minimum (q [N, K] in 0..15, scale and minimum
    [N, K/32] in 0..63, d and dmin fp16 [N, K/256]), as llama.cpp's Q4_K x Q8_K: activations quantized per 256,
    per super-block the exact integers sum(scale * dot) and sum(minimum * sum of 32 activations), then two float
    steps."""
    quantized, x_scales = quantize_activations(x, 256)  # [M, K/256, 256], [M, K/256]
    rows, supers, _ = quantized.shape
    xq = quantized.reshape(rows, supers * 8, 32).long()
    block_sums = xq.sum(-1)  # [M, K/32]
    scale, minimum = scale.long(), minimum.long()
    acc = torch.zeros(rows, q.shape[0])
    for s in range(supers):
        isum = torch.zeros(rows, q.shape[0], dtype=torch.long)
        msum = torch.zeros_like(isum)
        for c in range(8 * s, 8 * s + 8):
            dot = xq[:, c] @ q[:, c * 32:(c + 1) * 32].long().t()  # [M, N], exact
            isum += dot * scale[:, c][None]
            msum += block_sums[:, c:c + 1] * minimum[:, c][None]
        x_scale = x_scales[:, s:s + 1]
        acc = acc + isum.float() * (d[:, s].float()[None] * x_scale)
        acc = acc + msum.float() * ((-dmin[:, s].float())[None] * x_scale)
    return acc.to(x.dtype)


def q5k_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, d: torch.Tensor,
               dmin: torch.Tensor) -> torch.Tensor:
    """x [M, K] times GGUF's Q5_K weight, Q4_K's form with q [N, K] in 0..31: llama.cpp's Q5_K x Q8_K is its Q4_K x
    Q8_K arithmetic on the 5-bit values (the same exact integers per super-block, the same two float steps)."""
    return q4k_matmul(x, q, scale, minimum, d, dmin)


def q6k_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [M, K] times GGUF's Q6_K weight (d * scale) * (q - 32) (q [N, K] in 0..63, scale int8 [N, K/16], d fp16
    [N, K/256]), as llama.cpp's Q6_K x Q8_K: activations quantized per 256, per super-block the exact integer
    sum(scale * dot(q - 32, xq)) over its 16 sub-blocks, then one float step."""
    quantized, x_scales = quantize_activations(x, 256)  # [M, K/256, 256], [M, K/256]
    rows, supers, _ = quantized.shape
    xq = quantized.reshape(rows, supers * 16, 16).long()
    levels, scale = q.long() - 32, scale.long()
    acc = torch.zeros(rows, q.shape[0])
    for s in range(supers):
        isum = torch.zeros(rows, q.shape[0], dtype=torch.long)
        for j in range(16 * s, 16 * s + 16):
            isum += (xq[:, j] @ levels[:, j * 16:(j + 1) * 16].t()) * scale[:, j][None]
        acc = acc + isum.float() * (d[:, s].float()[None] * x_scales[:, s:s + 1])
    return acc.to(x.dtype)


def bf16_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 times weight [N, K] bf16 as bf16_fma.h computes it: [M, N] bf16. Per chunk of 32 columns, lane i
    adds the product of pair i's odd members, then of its even ones (vdpbf16ps's order; a product of two bf16 is exact
    in fp32, so `acc + a * b` rounds once, as an FMA); the 16 lanes folded as lanes i + 8, then a pairwise tree."""
    rows, cols = x.shape
    pairs_x = x.float().reshape(rows, 1, cols // 32, 16, 2)
    pairs_w = weight.float().reshape(1, weight.shape[0], cols // 32, 16, 2)
    acc = torch.zeros(rows, weight.shape[0], 16)
    for c in range(cols // 32):
        acc = acc + pairs_x[:, :, c, :, 1] * pairs_w[:, :, c, :, 1]
        acc = acc + pairs_x[:, :, c, :, 0] * pairs_w[:, :, c, :, 0]
    h = acc[..., :8] + acc[..., 8:]
    return (((h[..., 0] + h[..., 1]) + (h[..., 2] + h[..., 3]))
            + ((h[..., 4] + h[..., 5]) + (h[..., 6] + h[..., 7]))).to(torch.bfloat16)
