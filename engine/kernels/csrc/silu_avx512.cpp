// silu.h's SiLU(gate) * up on AVX512.
#include "float_avx512.h"
#include "kernels.h"
#include "silu.h"

namespace tern {

void silu_mul_avx512(const float* gate_up, float* act, int64_t inter, int64_t i0, int64_t i1) {
  silu::silu_mul<floats::Avx512>(gate_up, act, inter, i0, i1);
}

}  // namespace tern
