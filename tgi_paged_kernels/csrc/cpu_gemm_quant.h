// The packed GEMM of cpu_gemm.h on int8 weights dequantized inside the tile: codes [ceil(N / 16)][K][16] (uint8,
// the repo's IntLinear codes of 8 bits, one group per output channel: int_gemm.py), and per packed column a zero
// point and a scale (fp32, padding columns 0). Each weight is (code - zero) * scale in fp32 (code - zero exact, one
// rounding: dequantize_int's value) and enters the same sequential sum of fused multiply-adds as cpu_gemm.h's, so
// a row's result equals gemm_packed's on the dequantized weight bit for bit, on every ISA path here (AVX-512,
// AVX2 + FMA, scalar), while the weight streams at one byte per value. Internal linkage, like cpu_common.h.
// Torch reference: tgi_paged_kernels.cpu_quant (gemm_packed_int8_ref), compared in
// tests/kernels/test_cpu_gemm_quant.py.

#pragma once

#include "cpu_gemm.h"

namespace {

#if defined(__AVX512F__)
constexpr int kQuantMR = 12;  // rows per register tile: 12 accumulators of 16 lanes

template <int R>
inline void tile_i8(const float* a, int64_t lda, int64_t K, const uint8_t* codes, const float* zeros,
                    const float* scales, const float* bias, const float* add, int64_t ldadd, float* out, int64_t ldo,
                    int cols) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512 z = _mm512_loadu_ps(zeros), s = _mm512_loadu_ps(scales);
  for (int64_t k = 0; k < K; ++k) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * kNB));
    if (k % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(codes + (K + k) * kNB), _MM_HINT_T1);  // next panel
    const __m512 wk = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), z), s);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r * lda + k]), wk, acc[r]);
  }
  store_rows(acc, R, bias, add, ldadd, out, ldo, cols);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kQuantMR = 6;  // 6 rows x 2 halves of 8 lanes: 12 accumulators

inline __m256 dequant8(const uint8_t* codes, __m256 z, __m256 s) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes));
  return _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), z), s);
}

template <int R>
inline void tile_i8(const float* a, int64_t lda, int64_t K, const uint8_t* codes, const float* zeros,
                    const float* scales, const float* bias, const float* add, int64_t ldadd, float* out, int64_t ldo,
                    int cols) {
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  const __m256 z0 = _mm256_loadu_ps(zeros), z1 = _mm256_loadu_ps(zeros + 8);
  const __m256 s0 = _mm256_loadu_ps(scales), s1 = _mm256_loadu_ps(scales + 8);
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = dequant8(codes + k * kNB, z0, s0), w1 = dequant8(codes + k * kNB + 8, z1, s1);
    if (k % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(codes + (K + k) * kNB), _MM_HINT_T1);  // next panel
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_set1_ps(a[r * lda + k]);
      lo[r] = _mm256_fmadd_ps(x, w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(x, w1, hi[r]);
    }
  }
  float c[kNB];
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c, lo[r]);
    _mm256_storeu_ps(c + 8, hi[r]);
    epilogue(c, bias, add ? add + r * ldadd : nullptr, out + r * ldo, cols);
  }
}
#else
constexpr int kQuantMR = 4;

template <int R>
inline void tile_i8(const float* a, int64_t lda, int64_t K, const uint8_t* codes, const float* zeros,
                    const float* scales, const float* bias, const float* add, int64_t ldadd, float* out, int64_t ldo,
                    int cols) {
  float acc[R][kNB] = {};
  for (int64_t k = 0; k < K; ++k) {
    float w[kNB];
    for (int j = 0; j < kNB; ++j) w[j] = (static_cast<float>(codes[k * kNB + j]) - zeros[j]) * scales[j];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kNB; ++j) acc[r][j] = std::fma(a[r * lda + k], w[j], acc[r][j]);
  }
  for (int r = 0; r < R; ++r) epilogue(acc[r], bias, add ? add + r * ldadd : nullptr, out + r * ldo, cols);
}
#endif

template <int R>
inline void tile_i8_rows(int rows, const float* a, int64_t lda, int64_t K, const uint8_t* codes, const float* zeros,
                         const float* scales, const float* bias, const float* add, int64_t ldadd, float* out,
                         int64_t ldo, int cols) {
  if (rows == R) {
    tile_i8<R>(a, lda, K, codes, zeros, scales, bias, add, ldadd, out, ldo, cols);
  } else if constexpr (R > 1) {
    tile_i8_rows<R - 1>(rows, a, lda, K, codes, zeros, scales, bias, add, ldadd, out, ldo, cols);
  }
}

// gemm_packed (cpu_gemm.h) of the int8 weight `codes` with its per-column `zeros` and `scales`
// ([ceil(N / 16) * 16] each): out[M, N] = a[M, K] @ ((codes - zeros) * scales)^T (+ bias) (+ add). Orphaned work
// sharing over gemm_tasks, one column block a task.
void gemm_packed_i8(const float* a, int64_t lda, int64_t M, int64_t K, const uint8_t* codes, const float* zeros,
                    const float* scales, int64_t N, const float* bias, const float* add, int64_t ldadd, float* out,
                    int64_t ldo) {
  gemm_tasks(M, K, (N + kNB - 1) / kNB, kQuantMR, 96, [&](int64_t nb, int64_t m_begin, int64_t m_end) {
    const int64_t n0 = nb * kNB;
    const int cols = static_cast<int>(std::min<int64_t>(kNB, N - n0));
    for (int64_t m0 = m_begin; m0 < m_end; m0 += kQuantMR) {
      const int rows = static_cast<int>(std::min<int64_t>(kQuantMR, m_end - m0));
      tile_i8_rows<kQuantMR>(rows, a + m0 * lda, lda, K, codes + nb * K * kNB, zeros + n0, scales + n0,
                             bias ? bias + n0 : nullptr, add ? add + m0 * ldadd + n0 : nullptr, ldadd,
                             out + m0 * ldo + n0, ldo, cols);
    }
  });
}

}  // namespace
