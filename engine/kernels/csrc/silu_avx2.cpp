// silu.h's SiLU(gate) * up on AVX2.
#include "float_avx2.h"
#include "kernels.h"
#include "silu.h"

namespace tern {

void silu_mul_avx2(const float* gate_up, float* act, int64_t inter, int64_t i0, int64_t i1) {
  silu::silu_mul<floats::Avx2>(gate_up, act, inter, i0, i1);
}

}  // namespace tern
