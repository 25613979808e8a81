// The packed GEMM of cpu_gemm.h on one-byte weights decoded inside the tile: codes [ceil(N / 16)][K][16] (uint8)
// and per packed column a zero point and a scale (fp32, padding columns 0). Two code kinds (kFp8):
// - int8 (the repo's IntLinear codes of 8 bits, one group per output channel: int_gemm.py): each weight is
//   (code - zero) * scale in fp32 (code - zero exact, one rounding: dequantize_int's value);
// - fp8 e4m3 (Fp8Linear's per-channel weights: fp8_gemm.py; zeros unused): each weight is e4m3(code) * scale,
//   dequantize_fp8's value. The byte becomes the fp16 whose bits are (sign << 15) | (rest << 7), which is the
//   e4m3 value / 256 exactly (normal and subnormal), converted by the hardware (vcvtph2ps) and multiplied by
//   256 * scale (exact): the same real product, so the same rounding. e4m3fn's NaN codes (0x7F, 0xFF) would
//   decode as +-480: cpu_quant.pack_fp8 refuses them.
// Each weight enters the same sequential sum of fused multiply-adds as cpu_gemm.h's, so a row's result equals
// gemm_packed's on the dequantized weight bit for bit, on every ISA path here (AVX-512, AVX2 + FMA + F16C, scalar),
// while the weight streams at one byte per value. Internal linkage, like cpu_common.h. Torch reference:
// tgi_paged_kernels.cpu_quant (gemm_packed_int8_ref), compared in tests/kernels/test_cpu_gemm_quant.py.

#pragma once

#include "cpu_gemm.h"

namespace {

#if defined(__AVX512F__)
constexpr int kQuantMR = 12;  // rows per register tile: 12 accumulators of 16 lanes

// 16 weights of one k: int8 (code - z) * s, or fp8 fp16(code) * s (s: 256 * scale).
template <bool kFp8>
inline __m512 dequant16(const uint8_t* codes, __m512 z, __m512 s) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  if constexpr (kFp8) {
    const __m256i b = _mm256_cvtepu8_epi16(bytes);
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), s);
  } else {
    return _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), z), s);
  }
}

template <bool kFp8, int R>
inline void tile_i8(const float* a, int64_t lda, int64_t K, const uint8_t* codes, const float* zeros,
                    const float* scales, const float* bias, const float* add, int64_t ldadd, float* out, int64_t ldo,
                    int cols) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512 z = _mm512_loadu_ps(zeros);
  const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(scales), _mm512_set1_ps(kFp8 ? 256.0f : 1.0f));
  for (int64_t k = 0; k < K; ++k) {
    if (k % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(codes + (K + k) * kNB), _MM_HINT_T1);  // next panel
    const __m512 wk = dequant16<kFp8>(codes + k * kNB, z, s);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r * lda + k]), wk, acc[r]);
  }
  store_rows(acc, R, bias, add, ldadd, out, ldo, cols);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int kQuantMR = 6;  // 6 rows x 2 halves of 8 lanes: 12 accumulators

template <bool kFp8>
inline __m256 dequant8(const uint8_t* codes, __m256 z, __m256 s) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes));
  if constexpr (kFp8) {
    const __m128i b = _mm_cvtepu8_epi16(bytes);
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), s);
  } else {
    return _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), z), s);
  }
}

template <bool kFp8, int R>
inline void tile_i8(const float* a, int64_t lda, int64_t K, const uint8_t* codes, const float* zeros,
                    const float* scales, const float* bias, const float* add, int64_t ldadd, float* out, int64_t ldo,
                    int cols) {
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  const __m256 z0 = _mm256_loadu_ps(zeros), z1 = _mm256_loadu_ps(zeros + 8);
  const __m256 by = _mm256_set1_ps(kFp8 ? 256.0f : 1.0f);
  const __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(scales), by), s1 = _mm256_mul_ps(_mm256_loadu_ps(scales + 8), by);
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = dequant8<kFp8>(codes + k * kNB, z0, s0), w1 = dequant8<kFp8>(codes + k * kNB + 8, z1, s1);
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

// The e4m3 value of `code` / 256 (the fp16 the SIMD paths convert): 2^(e - 15) (1 + m / 8), or m 2^-17 for e = 0.
inline float fp8_over_256(uint8_t code) {
  const int e = (code >> 3) & 15, m = code & 7;
  const float v = e ? std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 15) : std::ldexp(static_cast<float>(m), -17);
  return code & 0x80 ? -v : v;
}

template <bool kFp8, int R>
inline void tile_i8(const float* a, int64_t lda, int64_t K, const uint8_t* codes, const float* zeros,
                    const float* scales, const float* bias, const float* add, int64_t ldadd, float* out, int64_t ldo,
                    int cols) {
  float acc[R][kNB] = {};
  for (int64_t k = 0; k < K; ++k) {
    float w[kNB];
    for (int j = 0; j < kNB; ++j) {
      const uint8_t c = codes[k * kNB + j];
      w[j] = kFp8 ? fp8_over_256(c) * (scales[j] * 256.0f) : (static_cast<float>(c) - zeros[j]) * scales[j];
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kNB; ++j) acc[r][j] = std::fma(a[r * lda + k], w[j], acc[r][j]);
  }
  for (int r = 0; r < R; ++r) epilogue(acc[r], bias, add ? add + r * ldadd : nullptr, out + r * ldo, cols);
}
#endif

template <bool kFp8, int R>
inline void tile_i8_rows(int rows, const float* a, int64_t lda, int64_t K, const uint8_t* codes, const float* zeros,
                         const float* scales, const float* bias, const float* add, int64_t ldadd, float* out,
                         int64_t ldo, int cols) {
  if (rows == R) {
    tile_i8<kFp8, R>(a, lda, K, codes, zeros, scales, bias, add, ldadd, out, ldo, cols);
  } else if constexpr (R > 1) {
    tile_i8_rows<kFp8, R - 1>(rows, a, lda, K, codes, zeros, scales, bias, add, ldadd, out, ldo, cols);
  }
}

// gemm_packed (cpu_gemm.h) of the one-byte weight `codes` with its per-column `zeros` and `scales`
// ([ceil(N / 16) * 16] each): out[M, N] = a[M, K] @ W^T (+ bias) (+ add), W = (codes - zeros) * scales (int8) or
// e4m3(codes) * scales (kFp8). Orphaned work sharing over gemm_tasks, one column block a task.
template <bool kFp8>
void gemm_packed_i8(const float* a, int64_t lda, int64_t M, int64_t K, const uint8_t* codes, const float* zeros,
                    const float* scales, int64_t N, const float* bias, const float* add, int64_t ldadd, float* out,
                    int64_t ldo) {
  gemm_tasks(M, K, (N + kNB - 1) / kNB, kQuantMR, 96, [&](int64_t nb, int64_t m_begin, int64_t m_end) {
    const int64_t n0 = nb * kNB;
    const int cols = static_cast<int>(std::min<int64_t>(kNB, N - n0));
    for (int64_t m0 = m_begin; m0 < m_end; m0 += kQuantMR) {
      const int rows = static_cast<int>(std::min<int64_t>(kQuantMR, m_end - m0));
      tile_i8_rows<kFp8, kQuantMR>(rows, a + m0 * lda, lda, K, codes + nb * K * kNB, zeros + n0, scales + n0,
                             bias ? bias + n0 : nullptr, add ? add + m0 * ldadd + n0 : nullptr, ldadd,
                             out + m0 * ldo + n0, ldo, cols);
    }
  });
}

}  // namespace
