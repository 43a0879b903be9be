// decode_attention.h's algorithm on AVX512F: 16 floats per register.
#include "decode_attention.h"
#include "float_avx512.h"

namespace tern {

void decode_attention_avx512(const AttentionProblem& p, int64_t task0, int64_t task1) {
  attention::attend<floats::Avx512>(p, task0, task1);
}

}  // namespace tern
