// bf16 x bf16 -> bf16 on AVX512 without AVX512-BF16 (bf16_fma.h).
#include "bf16_fma.h"

namespace tern {

void bf16_fma_groups_avx512(const Bf16Problem& p, int64_t g0, int64_t g1) {
  bf16_fma::groups<bf16_fma::Avx512>(p, g0, g1);
}

}  // namespace tern
