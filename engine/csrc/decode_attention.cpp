// Attention of decode steps (one new query per sequence) straight from the paged KV cache, registered as
// torch.ops.tern.paged_decode_attention.
//
//   out[b, h*D:(h+1)*D] = softmax(scale * q[b, h] . K[b]^T) V[b], over the first context_lens[b] positions,
//   K[b][l] = k_cache[context_slots[b, l], h / (H / Hkv)] (grouped-query heads share their KV head)
//
// The plain-PyTorch step gathers every sequence's context into a padded copy and runs two batched matmuls of
// tiny matrices (3 x 64 x ~200 per KV head): ~0.8 ms per layer at 16 sequences on 2 cores, a third of the step.
// Here each (sequence, KV head) pair reads its keys and values once, in place, with its query heads together.
//
// It rounds where the matmul path rounds, so the two agree to fp32 summation order: in bf16 each score is
// rounded to bf16 before scaling (matmul's output dtype), the probabilities are rounded to bf16 before they
// weight the values, and the output once at the end. Softmax is in fp32, as torch's. Each pair's arithmetic is
// the same whatever else is in the batch.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;  // floats per zmm register
// Rows are scattered over the cache's blocks and each is a few cache lines: without asking ahead, reading
// them waits on memory latency (a 16-sequence step's context came in at ~4 GB/s, not the ~20 the bus gives).
constexpr int64_t kPrefetch = 16;

template <typename T>
inline void prefetch_row(const T* row, int64_t D) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < D * static_cast<int64_t>(sizeof(T)); offset += 64)
    _mm_prefetch(bytes + offset, _MM_HINT_T0);
}

inline __m512 load_floats(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_floats(const uint16_t* p) {  // bf16 -> fp32: the bits, shifted into the top half
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

inline uint16_t round_to_bf16_bits(float value) {  // round to nearest, ties to even (finite values)
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

inline __m512 round_to_bf16(__m512 value) {  // the same rounding, kept as fp32
  const __m512i bits = _mm512_castps_si512(value);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// exp(x) to ~1 ulp (Cephes' expf polynomial, scaled by 2^n with vscalefps); x <= 0 here (x - max).
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(c));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

// Applies f to row[0..n) 16 at a time (a masked tail), returning the lanes' running sum or max of f's results.
template <typename F>
inline __m512 map_row(float* row, int64_t n, F f) {
  __m512 total = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 mask = n - i >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 result = f(_mm512_maskz_loadu_ps(mask, row + i));
    _mm512_mask_storeu_ps(row + i, mask, result);
    total = _mm512_mask_add_ps(total, mask, total, result);
  }
  return total;
}

inline void store_floats(float* p, const float* values, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] = values[i];
}
inline void store_floats(uint16_t* p, const float* values, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] = round_to_bf16_bits(values[i]);
}

// A thread's working memory, reused by every pair it attends to.
struct Scratch {
  std::vector<float> query, scores, acc;
};

// One (sequence, KV head) pair: its G query heads against its context.
template <typename T>
void attend_pair(const T* q, const T* k_cache, const T* v_cache, const int64_t* slots, int64_t length,
                 int64_t row_stride, int64_t G, int64_t D, float scale, bool round_like_bf16, T* out,
                 Scratch& scratch) {
  const int64_t vectors = D / kLanes;
  std::vector<float>& query = scratch.query;
  std::vector<float>& scores = scratch.scores;
  std::vector<float>& acc = scratch.acc;
  query.resize(G * D);
  scores.resize(G * length);
  acc.assign(G * D, 0.0f);
  for (int64_t i = 0; i < G * D; i += kLanes) _mm512_storeu_ps(&query[i], load_floats(q + i));
  for (int64_t l = 0; l < length; ++l) {
    if (l + kPrefetch < length) prefetch_row(k_cache + slots[l + kPrefetch] * row_stride, D);
    const T* key = k_cache + slots[l] * row_stride;
    for (int64_t g = 0; g < G; ++g) {
      __m512 dot = _mm512_setzero_ps();
      for (int64_t j = 0; j < vectors; ++j)
        dot = _mm512_fmadd_ps(_mm512_loadu_ps(&query[g * D + j * kLanes]), load_floats(key + j * kLanes), dot);
      scores[g * length + l] = _mm512_reduce_add_ps(dot);
    }
  }
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < G; ++g) {  // softmax in fp32, as torch's: exp(s - max) / sum
    float* row = &scores[g * length];
    float max_score = -std::numeric_limits<float>::infinity();
    map_row(row, length, [&](__m512 s) {
      s = _mm512_mul_ps(round_like_bf16 ? round_to_bf16(s) : s, scale_v);
      max_score = std::max(max_score, _mm512_reduce_max_ps(s));
      return s;
    });
    const __m512 max_v = _mm512_set1_ps(max_score);
    const __m512 sum = _mm512_set1_ps(_mm512_reduce_add_ps(
        map_row(row, length, [&](__m512 s) { return exp_ps(_mm512_sub_ps(s, max_v)); })));
    map_row(row, length, [&](__m512 e) {
      const __m512 p = _mm512_div_ps(e, sum);
      return round_like_bf16 ? round_to_bf16(p) : p;
    });
  }
  for (int64_t l = 0; l < length; ++l) {
    if (l + kPrefetch < length) prefetch_row(v_cache + slots[l + kPrefetch] * row_stride, D);
    const T* value = v_cache + slots[l] * row_stride;
    for (int64_t j = 0; j < vectors; ++j) {
      const __m512 v = load_floats(value + j * kLanes);
      for (int64_t g = 0; g < G; ++g) {
        float* a = &acc[g * D + j * kLanes];
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(scores[g * length + l]), v, _mm512_loadu_ps(a)));
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) store_floats(out + g * D, &acc[g * D], D);
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
         const at::Tensor& lengths, double scale, at::Tensor& out, bool round_like_bf16) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1), L = slots.size(1);
  const int64_t G = H / Hkv;
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k_cache.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v_cache.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t length = std::min(lp[b], L);
      attend_pair<T>(qp + (b * H + h * G) * D, kp + h * D, vp + h * D, sp + b * L, length, Hkv * D, G, D,
                     static_cast<float>(scale), round_like_bf16, op + (b * H + h * G) * D, scratch);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& context_slots, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: q [B, H, D], caches [slots, Hkv, D]");
  TORCH_CHECK(q.size(2) == k_cache.size(2) && q.size(2) % kLanes == 0, "head_dim must match and be a multiple of 16");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(context_slots.dim() == 2 && context_slots.size(0) == q.size(0) &&
                  context_slots.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
                  context_lens.numel() == q.size(0),
              "context_slots [B, L] and context_lens [B] must be int64");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  const at::Tensor slots = context_slots.contiguous(), lengths = context_lens.contiguous();
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  if (q.scalar_type() == at::kBFloat16) {
    run<uint16_t>(q, k_cache, v_cache, slots, lengths, scale, out, true);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_decode_attention takes bf16 or fp32");
    run<float>(q, k_cache, v_cache, slots, lengths, scale, out, false);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tern, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor context_slots, "
        "Tensor context_lens, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(tern, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
