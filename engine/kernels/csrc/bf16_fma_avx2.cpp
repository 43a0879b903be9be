// bf16 x bf16 -> bf16 on AVX2 (bf16_fma.h): AVX512's bits, two accumulators per output.
#include "bf16_fma.h"

namespace tern {

void bf16_fma_groups_avx2(const Bf16Problem& p, int64_t g0, int64_t g1) {
  bf16_fma::groups<bf16_fma::Avx2>(p, g0, g1);
}

}  // namespace tern
