// The bf16-weight GEMM of the CPU kernels (cpu_layer.cpp, cpu_moe.h, cpu_gemm.cpp): a [N, K] weight packed as
// [ceil(N / 16)][ceil(K / 2)][16][2] bf16 (each column's k pairs side by side: the VNNI layout of vdpbf16ps; K
// padded to even and columns to 16 with zeros; cpu_gemm_bf16.pack_weight_bf16), fp32 activations in, fp32
// accumulation and output, the epilogue (bias, add) of gemm_packed. Where the host has AMX-BF16 (and the build
// and the kernel allow it), AMX tiles (cpu_gemm_amx.h) at every row count, unless switched off: activations rounded
// to bf16 (RNE), fp32 tile sums; from 2 rows 1.2-3x the widening path's speed, 1 row about even (one
// Sapphire Rapids-class core). Otherwise, two arithmetics:
// - the widening path (AVX-512, AVX2 + FMA, scalar): the weights widened to fp32 (exact: even k = dword << 16, odd
//   k = dword & 0xffff0000) and fused multiply-adds in k order: the same bits as gemm_packed on the widened weights;
// - the dot path on AVX512-BF16 (cpu_gemm_bf16_dot.h; by default on AMD cores, where it is 1.7x faster): each
//   activation pair rounded to bf16 (RNE) and vdpbf16ps per pair (exact products, fp32 sums).
// Either way every output is one sequential sum over k: a row's result does not depend on its batch.
// Torch reference: cpu_layer_ref.gemm_packed_bf16_ref.

#pragma once

#include "cpu_gemm.h"
#include "cpu_gemm_amx.h"
#include "cpu_gemm_bf16_dot.h"

namespace {

#if defined(__AVX512F__)
constexpr int kMRb = 12;  // rows per register tile: 12 accumulators of 16 lanes

// Rows [0, R) of one column block: each pair's 16 dwords widened (even k: dword << 16, odd k: dword &
// 0xffff0000), fused multiply-adds in k order, then the epilogue.
template <int R>
inline void tile_bf16(const float* a, int64_t lda, int64_t K, const uint16_t* w, const float* bias, const float* add,
                      int64_t ldadd, float* out, int64_t ldo, int cols) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i odd_mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t k = 0; k < K; k += 2) {
    const __m512i d = _mm512_loadu_si512(w + (k / 2) * kPair);
    _mm_prefetch(reinterpret_cast<const char*>(w + ((K + 1) / 2 + k / 2) * kPair), _MM_HINT_T1);  // next panel
    const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(d, 16));
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r * lda + k]), even, acc[r]);
    if (k + 1 == K) break;  // K odd: the padded k has no activation
    const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(d, odd_mask));
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r * lda + k + 1]), odd, acc[r]);
  }
  store_rows(acc, R, bias, add, ldadd, out, ldo, cols);
}
#elif defined(__AVX2__) && defined(__FMA__)
// 5 rows x 2 halves of 8 lanes: 10 accumulators, the pair's two raw weight loads, their two even (then odd) widened
// halves, an activation and the mask: the 16 ymm registers. 6 rows spilled three accumulators to the stack (their FMA
// chains then ran through store-to-load forwarding; perf annotate on a Zen 3 core).
constexpr int kMRb = 5;

// Rows [0, R) of one column block: the pair's dwords widened (even k: dword << 16, odd k: dword & 0xffff0000),
// fused multiply-adds in k order, the sums stored to c[r * kNB ..]. Not inlined: its registers are allocated
// on its own (inlined into the task loop, the same code ran 1.2-1.6x slower at some row counts).
template <int R>
__attribute__((noinline)) void sums_bf16(const float* a, int64_t lda, int64_t K, const uint16_t* w, float* c) {
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  const __m256i odd_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t k = 0; k < K; k += 2) {
    const __m256i d0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (k / 2) * kPair));
    _mm_prefetch(reinterpret_cast<const char*>(w + ((K + 1) / 2 + k / 2) * kPair), _MM_HINT_T1);  // next panel
    const __m256i d1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (k / 2) * kPair + kNB));
    const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(d0, 16));
    const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(d1, 16));
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_set1_ps(a[r * lda + k]);
      lo[r] = _mm256_fmadd_ps(x, e0, lo[r]);
      hi[r] = _mm256_fmadd_ps(x, e1, hi[r]);
    }
    if (k + 1 == K) break;  // K odd: the padded k has no activation
    const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(d0, odd_mask));
    const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(d1, odd_mask));
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_set1_ps(a[r * lda + k + 1]);
      lo[r] = _mm256_fmadd_ps(x, o0, lo[r]);
      hi[r] = _mm256_fmadd_ps(x, o1, hi[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c + r * kNB, lo[r]);
    _mm256_storeu_ps(c + r * kNB + 8, hi[r]);
  }
}

template <int R>
inline void tile_bf16(const float* a, int64_t lda, int64_t K, const uint16_t* w, const float* bias, const float* add,
                      int64_t ldadd, float* out, int64_t ldo, int cols) {
  float c[R * kNB];
  sums_bf16<R>(a, lda, K, w, c);
  for (int r = 0; r < R; ++r) epilogue(c + r * kNB, bias, add ? add + r * ldadd : nullptr, out + r * ldo, cols);
}
#else
constexpr int kMRb = 4;

template <int R>
inline void tile_bf16(const float* a, int64_t lda, int64_t K, const uint16_t* w, const float* bias, const float* add,
                      int64_t ldadd, float* out, int64_t ldo, int cols) {
  float acc[R][kNB] = {};
  for (int64_t k = 0; k < K; ++k) {
    const uint16_t* wk = w + (k / 2) * kPair + (k % 2);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kNB; ++j) acc[r][j] = std::fma(a[r * lda + k], bf16_to_float(wk[2 * j]), acc[r][j]);
  }
  for (int r = 0; r < R; ++r) epilogue(acc[r], bias, add ? add + r * ldadd : nullptr, out + r * ldo, cols);
}
#endif

template <int R>
inline void tile_bf16_rows(int rows, const float* a, int64_t lda, int64_t K, const uint16_t* w, const float* bias,
                           const float* add, int64_t ldadd, float* out, int64_t ldo, int cols) {
  if (rows == R) {
    tile_bf16<R>(a, lda, K, w, bias, add, ldadd, out, ldo, cols);
  } else if constexpr (R > 1) {
    tile_bf16_rows<R - 1>(rows, a, lda, K, w, bias, add, ldadd, out, ldo, cols);
  }
}

// uint16 values of one packed [N, K] bf16 weight (an expert's stride in a stack of them).
inline int64_t packed_bf16_elements(int64_t N, int64_t K) { return (N + kNB - 1) / kNB * ((K + 1) / 2) * kPair; }

// out[M, N] = a[M, K] @ W^T (+ bias[N]) (+ add[M, N], which may be `out`), W packed as above; strides as
// gemm_packed's. Orphaned work sharing over gemm_tasks, one column block a task.
void gemm_packed_bf16(const float* a, int64_t lda, int64_t M, int64_t K, const uint16_t* packed, int64_t N,
                      const float* bias, const float* add, int64_t ldadd, float* out, int64_t ldo) {
  if (kAmxBuilt && amx_active()) {  // AMX tiles (cpu_gemm_amx.h): the activations rounded to bf16
    gemm_packed_bf16_amx(a, lda, M, K, packed, N, bias, add, ldadd, out, ldo);
    return;
  }
  if (kBf16DotBuilt && bf16_dot_active()) {  // vdpbf16ps (cpu_gemm_bf16_dot.h): the activations rounded to bf16
    gemm_packed_bf16_dot(a, lda, M, K, packed, N, bias, add, ldadd, out, ldo);
    return;
  }
  const int64_t block_elems = (K + 1) / 2 * kPair;
  gemm_tasks(M, K, (N + kNB - 1) / kNB, kMRb, 96, [&](int64_t nb, int64_t m_begin, int64_t m_end) {
    const int64_t n0 = nb * kNB;
    const int cols = static_cast<int>(std::min<int64_t>(kNB, N - n0));
    for (int64_t m0 = m_begin, rows = 0; m0 < m_end; m0 += rows) {
      rows = even_tile(m_end - m0, kMRb);
      tile_bf16_rows<kMRb>(rows, a + m0 * lda, lda, K, packed + nb * block_elems, bias ? bias + n0 : nullptr,
                           add ? add + m0 * ldadd + n0 : nullptr, ldadd, out + m0 * ldo + n0, ldo, cols);
    }
  });
}

// gemm_packed (weight_dtype 0: fp32 packed) or gemm_packed_bf16 (1), on a packed weight of that dtype.
inline void gemm_weights(int weight_dtype, const float* a, int64_t lda, int64_t M, int64_t K, const void* packed,
                         int64_t N, const float* bias, const float* add, int64_t ldadd, float* out, int64_t ldo) {
  if (weight_dtype == 1) {
    gemm_packed_bf16(a, lda, M, K, static_cast<const uint16_t*>(packed), N, bias, add, ldadd, out, ldo);
  } else {
    gemm_packed(a, lda, M, K, static_cast<const float*>(packed), N, bias, add, ldadd, out, ldo);
  }
}

// Bytes of one packed [N, K] weight of `weight_dtype` (an expert's stride in a stack of them).
inline int64_t packed_bytes(int weight_dtype, int64_t N, int64_t K) {
  return weight_dtype == 1 ? packed_bf16_elements(N, K) * 2 : (N + kNB - 1) / kNB * kNB * K * 4;
}

}  // namespace
