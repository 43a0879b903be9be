// int8 x int8 matmul for decode-sized batches on AVX512-VNNI CPUs, registered as torch.ops.tern.int8_vnni_mm.
// Build with -ffp-contract=off: a fused multiply-add would round differently from its PyTorch twin.
//
//   y[M, N] = sum_k xq[m, k] * w[n, k] * x_scale[m, k / block] * w_scale[n]
//
// The weight is int8 with one scale per output row (engine/quant.py's int8 mode). The activations are quantized
// here to int8 with one scale per block of up to 256 values, as llama.cpp does for its k-quant dot products
// (Q8_K), so 64 weights cost one vpdpbusd instead of a float conversion each. Batch-1 decode is bound by reading
// the weights, and the win comes as much from the layout as from the instruction: `pack` (engine/cpu_kernels.py)
// stores each group of 4 rows chunk-major, [N/4][K/64][4][64], so a thread reads one sequential stream.
// vpdpbusd multiplies unsigned by signed bytes: the packed weight holds w + 128 as uint8 and each activation
// chunk carries -128 * sum(xq) per int32 lane as the accumulator's starting value, which cancels the offset.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <tuple>
#include <vector>

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VNNI__)
#error "int8_vnni.cpp needs AVX512F, AVX512BW and AVX512-VNNI (built with -march=native)"
#endif

namespace {

constexpr int64_t kChunk = 64;  // int8 values per zmm register
constexpr int kRows = 4;        // weight rows per packed group

// One activation row, quantized: the int8 values, and per block the accumulator start (-128 * the sum of each
// int32 lane's values over the block) and the block's scale.
struct QuantizedRow {
  std::vector<int8_t> values;
  std::vector<int32_t> offsets;
  std::vector<float> scales;
};

inline __m512 load_floats(const void* base, int64_t index, bool bf16) {
  if (!bf16) return _mm512_loadu_ps(static_cast<const float*>(base) + index);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + index));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// One block of `block` activations from x[base...], quantized to out[0..block) (scale = absmax / 127, rounded to
// nearest even as torch.round does: cvtps_epi32 in the default MXCSR mode). Returns the block's absmax.
inline float quantize_block(const void* x, int64_t base, int64_t block, bool bf16, int8_t* out) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t i = 0; i < block; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_floats(x, base + i, bf16)));
  const float absmax = _mm512_reduce_max_ps(amax);
  const __m512 inv = _mm512_set1_ps(absmax > 0.f ? 127.f / absmax : 0.f);
  for (int64_t i = 0; i < block; i += 16) {
    const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(load_floats(x, base + i, bf16), inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(qi));
  }
  return absmax;
}

void quantize_row(const void* x, int64_t row, int64_t K, int64_t block_chunks, bool bf16, QuantizedRow& q) {
  const int64_t block = block_chunks * kChunk, blocks = K / block;
  q.values.resize(K);
  q.offsets.resize(blocks * 16);
  q.scales.resize(blocks);
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(128));
  for (int64_t b = 0; b < blocks; ++b) {
    const float absmax = quantize_block(x, row * K + b * block, block, bf16, q.values.data() + b * block);
    __m512i sums = _mm512_setzero_si512();  // 128 * sum of each lane's values
    for (int64_t i = 0; i < block; i += kChunk)
      sums = _mm512_dpbusd_epi32(sums, bias, _mm512_loadu_si512(q.values.data() + b * block + i));
    _mm512_storeu_si512(q.offsets.data() + b * 16, _mm512_sub_epi32(_mm512_setzero_si512(), sums));
    q.scales[b] = absmax / 127.f;
  }
}

// The sums of four int32 accumulators, as one 4-lane vector [sum(a0), sum(a1), sum(a2), sum(a3)] (exact).
inline __m128i reduce4(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
  auto half = [](__m512i a) { return _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1)); };
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(half(a0), half(a1)), _mm256_hadd_epi32(half(a2), half(a3)));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// out[m, n..n+3] for MB activation rows against one packed group of 4 weight rows. Each block's dot product is
// an exact integer; the float steps after it (acc += dot * x_scale, one block after another, then * w_scale,
// no fused multiply-add) are the ones cpu_kernels.int8_reference takes, so the two agree bit for bit.
template <int MB>
inline void group(const QuantizedRow* q, int64_t K, int64_t block_chunks, const uint8_t* w, __m128 w_scale,
                  float* out, int64_t N) {
  __m128 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm_setzero_ps();
  for (int64_t b = 0; b < K / (block_chunks * kChunk); ++b) {
    // At most 256 * 127 * 127 per lane: far from overflow, and exact as a float (< 2^24).
    __m512i dot[MB][kRows];
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < kRows; ++r) dot[m][r] = _mm512_loadu_si512(q[m].offsets.data() + b * 16);
    for (int64_t c = b * block_chunks; c < (b + 1) * block_chunks; ++c) {
      __m512i wv[kRows];
      for (int r = 0; r < kRows; ++r) wv[r] = _mm512_loadu_si512(w + (c * kRows + r) * kChunk);
      for (int m = 0; m < MB; ++m) {
        const __m512i xq = _mm512_loadu_si512(q[m].values.data() + c * kChunk);
        for (int r = 0; r < kRows; ++r) dot[m][r] = _mm512_dpbusd_epi32(dot[m][r], wv[r], xq);
      }
    }
    for (int m = 0; m < MB; ++m) {
      const __m128 sums = _mm_cvtepi32_ps(reduce4(dot[m][0], dot[m][1], dot[m][2], dot[m][3]));
      acc[m] = _mm_add_ps(acc[m], _mm_mul_ps(sums, _mm_set1_ps(q[m].scales[b])));
    }
  }
  for (int m = 0; m < MB; ++m) _mm_storeu_ps(out + m * N, _mm_mul_ps(acc[m], w_scale));
}

// Round to nearest even, as torch's float -> bfloat16 conversion does (finite values).
inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16));
}

inline __mmask16 tail_mask(int64_t n, int64_t end) {
  return n + 16 <= end ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (end - n)) - 1);
}

inline void store16(void* out, int64_t index, __m512 v, __mmask16 mask, bool bf16) {
  if (bf16) _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + index, mask, to_bf16(v));
  else _mm512_mask_storeu_ps(static_cast<float*>(out) + index, mask, v);
}

inline __m512 load_scales16(const void* base, int64_t index, __mmask16 mask, bool bf16) {
  if (!bf16) return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(base) + index);
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(base) + index);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

void store_rows(const float* src, void* out, int64_t M, int64_t N, int64_t n0, int64_t n1, bool bf16) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < n1; n += 16) {
      const __mmask16 mask = tail_mask(n, n1);
      store16(out, m * N + n, _mm512_maskz_loadu_ps(mask, src + m * N + n), mask, bf16);
    }
}

// Activations share one scale per block of up to 256 values (as llama.cpp's Q8_K): the largest of 256, 192,
// 128, 64 that divides K. Fewer scalings per weight is what makes a batch of rows cheaper than int8pack.
int64_t activation_block_chunks(int64_t K) {
  for (int64_t chunks : {4, 3, 2}) if (K % (chunks * kChunk) == 0) return chunks;
  return 1;
}

at::Tensor int8_vnni_mm(const at::Tensor& x, const at::Tensor& w_packed, const at::Tensor& w_scale) {
  TORCH_CHECK(x.dim() == 2 && w_packed.dim() == 2 && x.size(1) == w_packed.size(1),
              "int8_vnni_mm: x must be [M, K] and w_packed [N, K]");
  TORCH_CHECK(w_packed.scalar_type() == at::kByte && w_packed.is_contiguous(), "int8_vnni_mm: w_packed must be packed uint8");
  TORCH_CHECK((w_scale.scalar_type() == at::kFloat || w_scale.scalar_type() == at::kBFloat16) &&
              w_scale.is_contiguous() && w_scale.numel() == w_packed.size(0),
              "int8_vnni_mm: w_scale must be float32 or bfloat16 [N]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "int8_vnni_mm: x must be bfloat16 or float32");
  const int64_t M = x.size(0), K = x.size(1), N = w_packed.size(0);
  TORCH_CHECK(K % kChunk == 0 && N % kRows == 0, "int8_vnni_mm: K must be a multiple of 64 and N of 4");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;

  std::vector<QuantizedRow> q(M);
  const int64_t block_chunks = activation_block_chunks(K);
  for (int64_t m = 0; m < M; ++m) quantize_row(xc.data_ptr(), m, K, block_chunks, bf16, q[m]);
  std::vector<float> result(M * N);
  const uint8_t* w = w_packed.data_ptr<uint8_t>();
  const void* ws = w_scale.data_ptr();
  const bool bf16_scales = w_scale.scalar_type() == at::kBFloat16;
  at::parallel_for(0, N / kRows, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* wg = w + g * kRows * K;
      const __m128 scale = bf16_scales
          ? _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_loadl_epi64(
                reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(ws) + g * kRows))), 16))
          : _mm_loadu_ps(static_cast<const float*>(ws) + g * kRows);
      // The group's weights (4 x K bytes) stay in L1 while every group of 4 activation rows uses them.
      for (int64_t m = 0; m < M; m += 4) {
        float* o = result.data() + m * N + g * kRows;
        switch (std::min<int64_t>(4, M - m)) {
          case 1: group<1>(q.data() + m, K, block_chunks, wg, scale, o, N); break;
          case 2: group<2>(q.data() + m, K, block_chunks, wg, scale, o, N); break;
          case 3: group<3>(q.data() + m, K, block_chunks, wg, scale, o, N); break;
          default: group<4>(q.data() + m, K, block_chunks, wg, scale, o, N); break;
        }
      }
    }
    store_rows(result.data(), out.data_ptr(), M, N, g0 * kRows, g1 * kRows, bf16);
  });
  return out;
}

// The float epilogue of int8_vnni_mm for a batch whose block dot products came from elsewhere (torch._int_mm,
// for prefill): out[m, n] = (sum over blocks, in order, of dots[b, m, n] * x_scales[m, b]) * w_scale[n], with
// the same roundings as `group`, so a sequence gets the same bits whichever path its step took.
at::Tensor int8_combine_blocks(const at::Tensor& dots, const at::Tensor& x_scales, const at::Tensor& w_scale,
                               at::ScalarType out_dtype) {
  TORCH_CHECK(dots.dim() == 3 && dots.scalar_type() == at::kInt && dots.is_contiguous(), "dots must be int32 [blocks, M, N]");
  const int64_t blocks = dots.size(0), M = dots.size(1), N = dots.size(2);
  TORCH_CHECK(x_scales.scalar_type() == at::kFloat && x_scales.is_contiguous() && x_scales.numel() == M * blocks,
              "x_scales must be float32 [M, blocks]");
  TORCH_CHECK((w_scale.scalar_type() == at::kFloat || w_scale.scalar_type() == at::kBFloat16) &&
              w_scale.is_contiguous() && w_scale.numel() == N, "w_scale must be float32 or bfloat16 [N]");
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kFloat, "out_dtype must be bfloat16 or float32");
  at::Tensor out = at::empty({M, N}, dots.options().dtype(out_dtype));
  const int32_t* d = dots.data_ptr<int32_t>();
  const float* xs = x_scales.data_ptr<float>();
  const bool bf16_scales = w_scale.scalar_type() == at::kBFloat16, bf16_out = out_dtype == at::kBFloat16;
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t n = 0; n < N; n += 16) {
        const __mmask16 mask = tail_mask(n, N);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t b = 0; b < blocks; ++b) {
          const __m512 dot = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mask, d + (b * M + m) * N + n));
          acc = _mm512_add_ps(acc, _mm512_mul_ps(dot, _mm512_set1_ps(xs[m * blocks + b])));
        }
        acc = _mm512_mul_ps(acc, load_scales16(w_scale.data_ptr(), n, mask, bf16_scales));
        store16(out.data_ptr(), m * N + n, acc, mask, bf16_out);
      }
  });
  return out;
}

// The activations of a prefill-sized batch, quantized block by block as quantize_row does,
// laid out block-major for torch._int_mm: values int8 [blocks, M, block], scales float32 [M, blocks].
std::tuple<at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "quantize_activations: x must be bfloat16 or float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kChunk == 0, "quantize_activations: K must be a multiple of 64");
  const int64_t block = activation_block_chunks(K) * kChunk, blocks = K / block;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const at::Tensor xc = x.contiguous();
  at::Tensor values = at::empty({blocks, M, block}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({M, blocks}, x.options().dtype(at::kFloat));
  int8_t* v = values.data_ptr<int8_t>();
  float* sc = scales.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < blocks; ++b)
        sc[m * blocks + b] = quantize_block(xc.data_ptr(), m * K + b * block, block, bf16, v + (b * M + m) * block) / 127.f;
  });
  return {values, scales};
}

}  // namespace

TORCH_LIBRARY(tern, m) {
  m.def("int8_vnni_mm(Tensor x, Tensor w_packed, Tensor w_scale) -> Tensor");
  m.def("int8_combine_blocks(Tensor dots, Tensor x_scales, Tensor w_scale, ScalarType out_dtype) -> Tensor");
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(tern, CPU, m) {
  m.impl("int8_vnni_mm", &int8_vnni_mm);
  m.impl("int8_combine_blocks", &int8_combine_blocks);
  m.impl("quantize_activations", &quantize_activations);
}
