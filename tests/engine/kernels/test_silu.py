"""The native decode step's MLP activation, SiLU(gate) * up with a vectorized exp, on every path this CPU takes,
against torch's own silu: what a token's MLP computes whichever step serves it."""
from __future__ import annotations

import pytest
import torch
from conftest import require_op


@pytest.mark.parametrize("rows,inter", [(1, 8192), (16, 1536), (3, 37), (5, 1)])
def test_silu_mul_matches_torch_within_an_ulp_or_two(path_kernels, rows, inter):
    silu_mul = require_op(path_kernels.silu_mul, "SiLU")
    torch.manual_seed(rows * 1000 + inter)
    gate_up = torch.randn(rows, 2 * inter) * 6  # widths that leave every tail length of a register
    got = silu_mul(gate_up)
    want = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    assert got.shape == (rows, inter)
    torch.testing.assert_close(got, want, rtol=4e-6, atol=1e-30)


def test_silu_mul_saturates_as_silu_does_at_the_ends_of_the_float_range(path_kernels):
    silu_mul = require_op(path_kernels.silu_mul, "SiLU")
    gate = torch.tensor([-1e30, -1000.0, -100.0, -89.0, -88.5, -20.0, -0.0, 0.0, 1e-30, 20.0, 88.5, 89.0, 1000.0,
                         3e38])
    up = torch.tensor([2.0] * 13 + [0.5])
    got = silu_mul(torch.cat([gate, up])[None])[0]
    want = torch.nn.functional.silu(gate) * up
    # exp(-gate) overflows to +inf below about -88.7, as torch's does, so SiLU is -0 there, not a small number.
    assert torch.equal(got[:3].abs(), torch.zeros(3))
    torch.testing.assert_close(got, want, rtol=4e-6, atol=1e-30)
