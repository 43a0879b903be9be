// decode_attention.h's algorithm on AVX2 + FMA: 8 floats per register.
#include "decode_attention.h"
#include "float_avx2.h"

namespace tern {

void decode_attention_avx2(const AttentionProblem& p, int64_t task0, int64_t task1) {
  attention::attend<floats::Avx2>(p, task0, task1);
}

}  // namespace tern
