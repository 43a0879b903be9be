"""The packed weight layouts the kernels read: each round-trips to the row-order matrix, and a tied embedding reads
its rows straight from the packed copy."""
from __future__ import annotations

import torch

from engine.weights import quant
from engine.kernels import layouts


def test_q8_layout_round_trips_is_eight_and_a_half_bits_a_weight_and_rows_read_from_it():
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(-128, 128, (24, 96), dtype=torch.int8, generator=generator)
    d = torch.rand(24, 3, generator=generator).half()
    packed = layouts.pack_q8(q, d)
    assert packed.dtype == torch.uint8 and packed.shape == (24, 96 * 17 // 16)  # 8 bits + one fp16 per 32 values
    q2, d2 = layouts.unpack_q8(packed)
    assert torch.equal(q2, q) and torch.equal(d2, d)
    expected = (q.float().reshape(24, 3, 32) * d.float()[..., None]).reshape(24, 96)
    assert torch.equal(layouts.dequantize_q8(packed), expected)
    ids = torch.tensor([[0, 5, 23], [17, 17, 7]])
    assert torch.equal(layouts.q8_rows(packed, ids), expected[ids])


def test_int4_layout_round_trips_and_is_five_bits_a_weight():
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (24, 96), dtype=torch.uint8, generator=generator)
    d = torch.rand(24, 3, generator=generator).half()
    m = -torch.rand(24, 3, generator=generator).half()
    packed = layouts.pack_int4(q, d, m)
    assert packed.dtype == torch.uint8 and packed.shape == (24, 96 * 5 // 8)  # 4 bits + 2 fp16 per 32 values
    q2, d2, m2 = layouts.unpack_int4(packed)
    assert torch.equal(q2, q) and torch.equal(d2, d) and torch.equal(m2, m)
    expected = q.float().reshape(24, 3, 32) * d.float()[..., None] + m.float()[..., None]
    assert torch.equal(layouts.dequantize_int4(packed), expected.reshape(24, 96))


def test_q4_layout_round_trips_is_four_and_a_half_bits_a_weight_and_is_int4_with_m_minus_eight_d():
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (24, 96), dtype=torch.uint8, generator=generator)
    d = torch.rand(24, 3, generator=generator).half()
    packed = layouts.pack_q4(q, d)
    assert packed.dtype == torch.uint8 and packed.shape == (24, 96 * 9 // 16)  # 4 bits + one fp16 per 32 values
    q2, d2 = layouts.unpack_q4(packed)
    assert torch.equal(q2, q) and torch.equal(d2, d)
    expected = ((q.float() - 8).reshape(24, 3, 32) * d.float()[..., None]).reshape(24, 96)
    assert torch.equal(layouts.dequantize_q4(packed), expected)
    assert torch.equal(layouts.dequantize_int4(layouts.q4_as_int4(packed)), expected)
    ids = torch.tensor([[0, 5, 23], [17, 17, 7]])
    assert torch.equal(layouts.q4_rows(packed, ids), expected[ids])


def test_q4k_layout_round_trips_is_four_and_a_half_bits_a_weight_and_holds_q4_k_values():
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (24, 512), dtype=torch.uint8, generator=generator)
    scale, minimum = (torch.randint(0, 64, (24, 16), dtype=torch.uint8, generator=generator) for _ in range(2))
    d, dmin = torch.rand(24, 2, generator=generator).half(), torch.rand(24, 2, generator=generator).half()
    packed = layouts.pack_q4k(q, scale, minimum, d, dmin)
    assert packed.dtype == torch.uint8 and packed.shape == (24, 512 * 9 // 16)  # Q4_K's 144 bytes per 256 values
    for got, want in zip(layouts.unpack_q4k(packed), (q, scale, minimum, d, dmin)):
        assert torch.equal(got, want)
    per_block = lambda s: s.float().repeat_interleave(8, dim=1)[..., None]  # noqa: E731
    expected = ((q.float().reshape(24, 16, 32) * (per_block(d) * scale.float()[..., None]))
                - per_block(dmin) * minimum.float()[..., None]).reshape(24, 512)
    assert torch.equal(layouts.dequantize_q4k(packed), expected)
    ids = torch.tensor([[0, 5, 23], [17, 17, 7]])
    assert torch.equal(layouts.q4k_rows(packed, ids), expected[ids])
    # In int4's layout (aten's int4pack where no kernel serves) the scales are rounded to fp16: close, not equal.
    as_int4 = layouts.dequantize_int4(layouts.q4k_as_int4(packed))
    assert (as_int4 - expected).abs().max() <= 2.0**-9 * expected.abs().max()


def test_q5k_layout_round_trips_is_five_and_a_half_bits_a_weight_and_holds_q5_k_values():
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 32, (24, 512), dtype=torch.uint8, generator=generator)
    scale, minimum = (torch.randint(0, 64, (24, 16), dtype=torch.uint8, generator=generator) for _ in range(2))
    d, dmin = torch.rand(24, 2, generator=generator).half(), torch.rand(24, 2, generator=generator).half()
    packed = layouts.pack_q5k(q, scale, minimum, d, dmin)
    assert packed.dtype == torch.uint8 and packed.shape == (24, 512 * 11 // 16)  # Q5_K's 176 bytes per 256 values
    for got, want in zip(layouts.unpack_q5k(packed), (q, scale, minimum, d, dmin)):
        assert torch.equal(got, want)
    # The fifth bits where the kernels read them: group 0, super-block 0, sub-block 0's 32 bytes after its nibbles:
    # byte 4r + t, bit k: nibble register k's low-nibble value (column 8k + t), bit 4 + k: its high one (8k + 4 + t).
    fifth = packed.reshape(3, 2, 1408)[0, 0, 128 + 128:128 + 160].long()
    for r in range(8):
        for t in range(4):
            for k in range(4):
                assert (fifth[4 * r + t] >> k) & 1 == q[r, 8 * k + t] >> 4
                assert (fifth[4 * r + t] >> (4 + k)) & 1 == q[r, 8 * k + 4 + t] >> 4
    per_block = lambda s: s.float().repeat_interleave(8, dim=1)  # noqa: E731
    # gguf's order: (d * scale) * q - (dmin * minimum)
    expected = (q.float().reshape(24, 16, 32) * (per_block(d) * scale.float())[..., None]
                - (per_block(dmin) * minimum.float())[..., None]).reshape(24, 512)
    assert torch.equal(layouts.dequantize_q5k(packed), expected)
    ids = torch.tensor([[0, 5, 23], [17, 17, 7]])
    assert torch.equal(layouts.q5k_rows(packed, ids), expected[ids])


def test_q6k_layout_round_trips_is_six_and_a_half_bits_a_weight_and_holds_q6_k_values():
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 64, (24, 512), dtype=torch.uint8, generator=generator)
    scale = torch.randint(-128, 128, (24, 32), generator=generator).to(torch.int8)  # -128 too: files may hold it
    d = torch.rand(24, 2, generator=generator).half()
    packed = layouts.pack_q6k(q, scale, d)
    assert packed.dtype == torch.uint8 and packed.shape == (24, 512 * 105 // 128)  # Q6_K's 210 bytes per 256 values
    for got, want in zip(layouts.unpack_q6k(packed), (q, scale, d)):
        assert torch.equal(got, want)
    per_sub = d.float().repeat_interleave(16, dim=1) * scale.float()  # gguf's order: (d * scale) * (q - 32)
    expected = (per_sub[..., None] * (q.float() - 32).reshape(24, 32, 16)).reshape(24, 512)
    assert torch.equal(layouts.dequantize_q6k(packed), expected)
    ids = torch.tensor([[0, 5, 23], [17, 17, 7]])
    assert torch.equal(layouts.q6k_rows(packed, ids), expected[ids])


def test_bf16_layout_round_trips_and_rows_read_from_it():
    weight = torch.randn(12, 96).to(torch.bfloat16)
    packed = layouts.pack_bf16(weight)
    assert packed.dtype == torch.bfloat16 and packed.shape == weight.shape and not torch.equal(packed, weight)
    assert torch.equal(layouts.unpack_bf16(packed), weight)
    ids = torch.tensor([[0, 5, 11], [3, 3, 7]])
    assert torch.equal(layouts.bf16_rows(packed, ids), weight[ids])


def test_int4_quantization_gives_a_4bit_checkpoint_its_own_values_back():
    """A de-quantized Q4_1 block (16 evenly spaced levels from an fp16 step and minimum) survives exactly; any
    other weight lands within half a step of where it was."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (16, 128), dtype=torch.uint8, generator=generator)
    q[:, ::32], q[:, 1::32] = 0, 15  # each block uses its lowest and highest level, as Q4_1 blocks do
    d = (torch.rand(16, 4, generator=generator) / 20).half()
    m = (-torch.rand(16, 4, generator=generator) / 5).half()
    weight = layouts.dequantize_int4(layouts.pack_int4(q, d, m))
    q2, d2, m2 = quant.quantize_int4(weight)
    assert torch.equal(q2, q) and torch.equal(d2, d) and torch.equal(m2, m)

    other = torch.randn(16, 128, generator=generator)
    q3, d3, m3 = quant.quantize_int4(other)
    back = layouts.dequantize_int4(layouts.pack_int4(q3, d3, m3))
    step = d3.float().repeat_interleave(32, dim=1)
    assert ((back - other).abs() <= step * 0.5 + 2e-3).all()  # half a step, plus the fp16 rounding of d and m
    constant = torch.full((8, 32), 0.25)
    q4, d4, m4 = quant.quantize_int4(constant)  # a block with one value: step 0, all of it in the minimum
    assert torch.equal(layouts.dequantize_int4(layouts.pack_int4(q4, d4, m4)), constant)


def test_each_block_layouts_row_lookup_gives_the_rows_of_its_whole_matrix_for_any_number_of_ids():
    """An embedding's lookup moves only its rows' bytes (8 ids to a group); whatever the count, repeats and groups
    the ids fall in, each row is the de-quantized matrix's row, bit for bit."""
    generator = torch.Generator().manual_seed(1)
    rows, cols = 40, 512
    q4, q5, q6 = (torch.randint(0, top, (rows, cols), dtype=torch.uint8, generator=generator) for top in (16, 32, 64))
    per32 = lambda: torch.rand(rows, cols // 32, generator=generator).half()  # noqa: E731
    per256 = lambda: torch.rand(rows, cols // 256, generator=generator).half()  # noqa: E731
    levels = lambda: torch.randint(0, 64, (rows, cols // 32), dtype=torch.uint8, generator=generator)  # noqa: E731
    cases = {
        "q8": (layouts.pack_q8(torch.randint(-128, 128, (rows, cols), dtype=torch.int8, generator=generator), per32()),
               layouts.q8_rows, layouts.dequantize_q8),
        "int4": (layouts.pack_int4(q4, per32(), -per32()), layouts.int4_rows, layouts.dequantize_int4),
        "q4": (layouts.pack_q4(q4, per32()), layouts.q4_rows, layouts.dequantize_q4),
        "q4k": (layouts.pack_q4k(q4, levels(), levels(), per256(), per256()), layouts.q4k_rows, layouts.dequantize_q4k),
        "q5k": (layouts.pack_q5k(q5, levels(), levels(), per256(), per256()), layouts.q5k_rows, layouts.dequantize_q5k),
        "q6k": (layouts.pack_q6k(q6, torch.randint(-128, 128, (rows, cols // 16), generator=generator).to(torch.int8),
                                 per256()), layouts.q6k_rows, layouts.dequantize_q6k),
    }
    for name, (packed, lookup, dequantize) in cases.items():
        whole = dequantize(packed)
        for ids in (torch.tensor([39]), torch.tensor([3, 3, 8, 15, 16, 39, 0, 7, 24, 31, 9, 9, 17]),
                    torch.randint(0, rows, (5, 7), generator=generator), torch.arange(rows).flip(0)):
            assert torch.equal(lookup(packed, ids), whole[ids]), (name, ids)
        assert lookup(packed, torch.tensor([], dtype=torch.long)).shape == (0, cols), name
