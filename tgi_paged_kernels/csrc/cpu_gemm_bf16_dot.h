// The vdpbf16ps bf16 GEMM (AVX512-BF16) of cpu_gemm_bf16.h: weights packed [ceil(N / 16)][ceil(K / 2)][16][2]
// (the VNNI layout), each activation pair rounded to bf16 (RNE, as a torch bf16 model holds activations) and one
// vdpbf16ps per pair and 16 columns, which adds the pair's odd product then its even one (exact products, fp32
// sums): the bits of cpu_layer_ref.gemm_packed_bf16_ref(rounds_activations=True). Tiles of 12 rows x 32 columns
// (two column blocks: one broadcast per two vdpbf16ps), the activations rounded per 64 pairs on the stack.
//
// Where it runs: a runtime switch (tgi_paged_gemm_bf16_dot), on by default on AMD cores and off elsewhere. A Zen 4
// core issues one 512-bit FMA a cycle and one vdpbf16ps (two products a lane): the dot path does twice the work a
// cycle of the widening path, 1.7x its speed at 20 rows x SmolLM2's projections (2 threads,
// examples/bench_packed_linears.py --bf16-paths). A Sapphire Rapids-class core issues two FMAs a cycle and one
// vdpbf16ps: there the dot path ran 1.2-1.6x the widening path's time from 8 rows up (and AMX serves bf16 anyway).
#pragma once

#include <atomic>
#include <cstdint>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "cpu_gemm.h"

namespace tgi_paged {

// Whether the CPU is AMD's (cpuid leaf 0's vendor string "AuthenticAMD").
inline bool amd_cpu() {
#if defined(__x86_64__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
  return ebx == 0x68747541u && edx == 0x69746e65u && ecx == 0x444d4163u;  // "Auth" "enti" "cAMD"
#else
  return false;
#endif
}

// The runtime switch of the dot path (one for every source file of the library, as amx_switch).
inline std::atomic<bool>& bf16_dot_switch() {
  static std::atomic<bool> on{amd_cpu()};
  return on;
}

}  // namespace tgi_paged

namespace {

using tgi_paged::bf16_dot_switch;

constexpr int kPair = 2 * kNB;  // bf16 values of one k pair of a packed block (16 columns x 2)

#if defined(__AVX512BF16__)
constexpr bool kBf16DotBuilt = true;
constexpr int kDotRows = 12;  // rows per register tile: 2 x 12 accumulators, 2 weight registers, 1 broadcast
constexpr int kDotPairs = 64;  // k pairs of activations rounded per pass (a [kDotRows][64] dword buffer on the stack)

inline bool bf16_dot_active() { return bf16_dot_switch().load(std::memory_order_relaxed); }

// Pairs [p0, p0 + np) of rows [0, R) of a (K floats a row), rounded to bf16 pairs: pairs[r][p - p0], the pair past
// K zero.
template <int R>
inline void round_pairs(const float* a, int64_t lda, int64_t K, int64_t p0, int np, uint32_t (*pairs)[kDotPairs]) {
  for (int r = 0; r < R; ++r) {  // 32 activations (16 pairs) per conversion, the tail masked to zeros
    const float* src = a + r * lda + 2 * p0;
    const int64_t left = K - 2 * p0;
    for (int p = 0; p < np; p += 16) {
      const int64_t n0 = std::clamp<int64_t>(left - 2 * p, 0, 16), n1 = std::clamp<int64_t>(left - 2 * p - 16, 0, 16);
      const __m512 lo = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n0) - 1u), src + 2 * p);
      const __m512 hi = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n1) - 1u), src + 2 * p + 16);
      _mm512_store_si512(pairs[r] + p, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
  }
}

// Rows [0, R) of one or two neighbouring column blocks (w1 null: one; the second has `cols1` valid columns).
template <int R>
inline void tile_bf16_dot(const float* a, int64_t lda, int64_t K, const uint16_t* w0, const uint16_t* w1,
                          const float* bias, const float* add, int64_t ldadd, float* out, int64_t ldo, int cols0,
                          int cols1) {
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  alignas(64) uint32_t pairs[R][kDotPairs];
  const int64_t K2 = (K + 1) / 2, ahead = (w1 ? 2 : 1) * K2 * kPair;  // the next task's panels
  for (int64_t p0 = 0; p0 < K2; p0 += kDotPairs) {
    const int np = static_cast<int>(std::min<int64_t>(kDotPairs, K2 - p0));
    round_pairs<R>(a, lda, K, p0, np, pairs);
    const uint16_t *wp0 = w0 + p0 * kPair, *wp1 = w1 ? w1 + p0 * kPair : nullptr;
    for (int p = 0; p < np; ++p) {
      const __m512bh x0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(wp0 + p * kPair));
      _mm_prefetch(reinterpret_cast<const char*>(wp0 + ahead + p * kPair), _MM_HINT_T1);
      if (wp1) {
        const __m512bh x1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(wp1 + p * kPair));
        _mm_prefetch(reinterpret_cast<const char*>(wp1 + ahead + p * kPair), _MM_HINT_T1);
        for (int r = 0; r < R; ++r) {
          const __m512bh x = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pairs[r][p])));
          acc0[r] = _mm512_dpbf16_ps(acc0[r], x, x0);
          acc1[r] = _mm512_dpbf16_ps(acc1[r], x, x1);
        }
      } else {
        for (int r = 0; r < R; ++r)
          acc0[r] = _mm512_dpbf16_ps(acc0[r], reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pairs[r][p]))), x0);
      }
    }
  }
  store_rows(acc0, R, bias, add, ldadd, out, ldo, cols0);
  if (w1) store_rows(acc1, R, bias ? bias + kNB : nullptr, add ? add + kNB : nullptr, ldadd, out + kNB, ldo, cols1);
}

template <int R>
inline void tile_bf16_dot_rows(int rows, const float* a, int64_t lda, int64_t K, const uint16_t* w0,
                               const uint16_t* w1, const float* bias, const float* add, int64_t ldadd, float* out,
                               int64_t ldo, int cols0, int cols1) {
  if (rows == R) {
    tile_bf16_dot<R>(a, lda, K, w0, w1, bias, add, ldadd, out, ldo, cols0, cols1);
  } else if constexpr (R > 1) {
    tile_bf16_dot_rows<R - 1>(rows, a, lda, K, w0, w1, bias, add, ldadd, out, ldo, cols0, cols1);
  }
}

// gemm_packed_bf16's contract on the dot path: two column blocks a task (the last alone when their count is odd).
inline void gemm_packed_bf16_dot(const float* a, int64_t lda, int64_t M, int64_t K, const uint16_t* packed,
                                 int64_t N, const float* bias, const float* add, int64_t ldadd, float* out,
                                 int64_t ldo) {
  const int64_t blocks = (N + kNB - 1) / kNB, block_elems = (K + 1) / 2 * kPair;
  gemm_tasks(M, K, (blocks + 1) / 2, kDotRows, 96, [&](int64_t group, int64_t m_begin, int64_t m_end) {
    const int64_t nb = 2 * group, n0 = nb * kNB;
    const bool two = nb + 1 < blocks;
    const int cols0 = static_cast<int>(std::min<int64_t>(kNB, N - n0));
    const int cols1 = two ? static_cast<int>(std::min<int64_t>(kNB, N - n0 - kNB)) : 0;
    const uint16_t* w0 = packed + nb * block_elems;
    for (int64_t m0 = m_begin; m0 < m_end; m0 += kDotRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kDotRows, m_end - m0));
      tile_bf16_dot_rows<kDotRows>(rows, a + m0 * lda, lda, K, w0, two ? w0 + block_elems : nullptr,
                                   bias ? bias + n0 : nullptr, add ? add + m0 * ldadd + n0 : nullptr, ldadd,
                                   out + m0 * ldo + n0, ldo, cols0, cols1);
    }
  });
}
#else
constexpr bool kBf16DotBuilt = false;
inline bool bf16_dot_active() { return false; }
inline void gemm_packed_bf16_dot(const float*, int64_t, int64_t, int64_t, const uint16_t*, int64_t, const float*,
                                 const float*, int64_t, float*, int64_t) {}
#endif

}  // namespace
