// SiLU(gate) * up, the gated MLP's activation, written once for every instruction set (V: float_avx2.h,
// float_avx512.h) as torch computes it, gate / (1 + exp(-gate)) * up, with V's exp (~1 ulp, as torch's own
// vectorized exp). libm's scalar expf, one call per value, was ~5% of a 16-row decode step of a 1B model.
#pragma once

#include <algorithm>
#include <cstdint>

namespace tern::silu {

// act[i] = SiLU(gate) * up for i in [i0, i1) of rows x inter values, where row b of gate_up holds its inter gates,
// then its inter ups (a fused gate_up matmul's output).
template <class V>
void silu_mul(const float* gate_up, float* act, int64_t inter, int64_t i0, int64_t i1) {
  using Reg = typename V::Reg;
  const Reg one = V::set1(1.0f), zero = V::zero();
  auto value = [&](Reg gate, Reg up) { return V::mul(V::div(gate, V::add(one, V::exp(V::sub(zero, gate)))), up); };
  for (int64_t i = i0; i < i1;) {
    const int64_t b = i / inter, end = std::min(i1, (b + 1) * inter);
    const float* gate = gate_up + b * inter;  // indexed by i: row b's gate at i - b * inter, its up inter further
    const float* up = gate + inter;
    for (; i + V::kLanes <= end; i += V::kLanes) V::store(act + i, value(V::load(gate + i), V::load(up + i)));
    if (i < end) {
      const typename V::Mask mask = V::tail_mask(end - i);
      V::store_masked(act + i, mask, value(V::load_masked(gate + i, mask), V::load_masked(up + i, mask)));
      i = end;
    }
  }
}

}  // namespace tern::silu
