// The packed-weight GEMM of the CPU kernels (cpu_layer.cpp, cpu_prefill.cpp): a [N, K] weight (torch's
// nn.Linear layout) packed as [ceil(N / 16)][K][16], columns padded with zeros (pack_weight in cpu_layer.py).
// Every output is one sequential sum over k of fused multiply-adds, whatever the ISA (AVX-512, AVX2 + FMA,
// scalar) and the number of rows or threads: a row's result does not depend on the batch it is in, and the
// three ISAs give the same bits. Internal linkage, like cpu_common.h.

#pragma once

#include "cpu_common.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int kNB = 16;  // columns of a packed block

// out[j] = add[j] + (c[j] + bias[j]) for the `cols` valid columns of a block (bias/add may be null).
inline void epilogue(const float* c, const float* bias, const float* add, float* out, int cols) {
  for (int j = 0; j < cols; ++j) {
    float v = c[j];
    if (bias) v += bias[j];
    out[j] = add ? add[j] + v : v;
  }
}

// tile<R>: rows [0, R) of one column block, acc[r] = sum_k a[r, k] * w[k, :] (fused multiply-adds in k
// order), written through the epilogue's arithmetic to `out`.
#if defined(__AVX512F__)
constexpr int kMR = 12;  // rows per register tile of one block: 12 accumulators of 16 lanes
constexpr int kMR2 = 12;  // rows per register tile of two blocks: 24 accumulators, one broadcast per two FMAs
constexpr bool kPairs = true;

inline void store_rows(const __m512* acc, int rows, const float* bias, const float* add, int64_t ldadd, float* out,
                       int64_t ldo, int cols) {  // the epilogue's arithmetic, 16 lanes at once
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r) {
    __m512 v = bias ? _mm512_add_ps(acc[r], b) : acc[r];
    if (add) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, add + r * ldadd), v);
    _mm512_mask_storeu_ps(out + r * ldo, mask, v);
  }
}

template <int R>
inline void tile(const float* a, int64_t lda, int64_t K, const float* w, const float* bias, const float* add,
                 int64_t ldadd, float* out, int64_t ldo, int cols) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 wk = _mm512_loadu_ps(w + k * kNB);
    _mm_prefetch(reinterpret_cast<const char*>(w + (K + k) * kNB), _MM_HINT_T1);  // the next panel, a line a step
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r * lda + k]), wk, acc[r]);
  }
  store_rows(acc, R, bias, add, ldadd, out, ldo, cols);
}

// Two neighbouring column blocks (w0, then w1 = the next block; the second has `cols1` valid columns).
template <int R>
inline void tile2(const float* a, int64_t lda, int64_t K, const float* w0, const float* w1, const float* bias,
                  const float* add, int64_t ldadd, float* out, int64_t ldo, int cols1) {
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 x0 = _mm512_loadu_ps(w0 + k * kNB), x1 = _mm512_loadu_ps(w1 + k * kNB);
    _mm_prefetch(reinterpret_cast<const char*>(w0 + (2 * K + k) * kNB), _MM_HINT_T1);  // the next pair's panels
    _mm_prefetch(reinterpret_cast<const char*>(w1 + (2 * K + k) * kNB), _MM_HINT_T1);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * lda + k]);
      acc0[r] = _mm512_fmadd_ps(x, x0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(x, x1, acc1[r]);
    }
  }
  store_rows(acc0, R, bias, add, ldadd, out, ldo, kNB);
  store_rows(acc1, R, bias ? bias + kNB : nullptr, add ? add + kNB : nullptr, ldadd, out + kNB, ldo, cols1);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kMR = 6;  // 6 rows x 2 halves of 8 lanes: 12 accumulators
constexpr int kMR2 = 1;
constexpr bool kPairs = false;
template <int R>
inline void tile(const float* a, int64_t lda, int64_t K, const float* w, const float* bias, const float* add,
                 int64_t ldadd, float* out, int64_t ldo, int cols) {
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(w + k * kNB), w1 = _mm256_loadu_ps(w + k * kNB + 8);
    _mm_prefetch(reinterpret_cast<const char*>(w + (K + k) * kNB), _MM_HINT_T1);  // the next panel, a line a step
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
constexpr int kMR = 4;
constexpr int kMR2 = 1;
constexpr bool kPairs = false;
template <int R>
inline void tile(const float* a, int64_t lda, int64_t K, const float* w, const float* bias, const float* add,
                 int64_t ldadd, float* out, int64_t ldo, int cols) {
  float acc[R][kNB] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kNB; ++j) acc[r][j] = std::fma(a[r * lda + k], w[k * kNB + j], acc[r][j]);
  for (int r = 0; r < R; ++r) epilogue(acc[r], bias, add ? add + r * ldadd : nullptr, out + r * ldo, cols);
}
#endif

template <int R>
inline void tile_rows(int rows, const float* a, int64_t lda, int64_t K, const float* w, const float* bias,
                      const float* add, int64_t ldadd, float* out, int64_t ldo, int cols) {
  if (rows == R) {
    tile<R>(a, lda, K, w, bias, add, ldadd, out, ldo, cols);
  } else if constexpr (R > 1) {
    tile_rows<R - 1>(rows, a, lda, K, w, bias, add, ldadd, out, ldo, cols);
  }
}

#if defined(__AVX512F__)
template <int R>
inline void tile2_rows(int rows, const float* a, int64_t lda, int64_t K, const float* w0, const float* w1,
                       const float* bias, const float* add, int64_t ldadd, float* out, int64_t ldo, int cols1) {
  if (rows == R) {
    tile2<R>(a, lda, K, w0, w1, bias, add, ldadd, out, ldo, cols1);
  } else if constexpr (R > 1) {
    tile2_rows<R - 1>(rows, a, lda, K, w0, w1, bias, add, ldadd, out, ldo, cols1);
  }
}
#endif

// Rows of the next register tile of at most `tile` rows when `left` rows remain: the rest in equal tiles (12 rows
// of 5-row tiles as 4 + 4 + 4, not 5 + 5 + 2, whose short tile has too few accumulators to hide the FMA latency).
inline int even_tile(int64_t left, int tile) {
  const int64_t tiles = (left + tile - 1) / tile;
  return static_cast<int>((left + tiles - 1) / tiles);
}

// Rows per task of a GEMM of M rows: at most kMaxRows, the chunks equal up to one register tile (`tile_rows`
// rows), so that threads taking equal numbers of tasks get equal work (128 rows as 96 + 32 left one of two
// threads a quarter of the work).
inline int64_t balanced_row_chunk(int64_t M, int64_t tile_rows, int64_t kMaxRows = 96) {
  const int64_t chunks = std::max<int64_t>(1, (M + kMaxRows - 1) / kMaxRows);
  const int64_t rows = (M + chunks - 1) / chunks;
  return std::max<int64_t>(tile_rows, (rows + tile_rows - 1) / tile_rows * tile_rows);
}

// Rows of `a` (fp32, K a row) a GEMM keeps in cache while every column panel passes over them once: about
// 1 MiB of them in whole chunks of `chunk` rows, so the weight streams from memory once per this many rows.
inline int64_t cached_rows(int64_t M, int64_t K, int64_t chunk) {
  const int64_t fit = (int64_t{1} << 20) / (4 * std::max<int64_t>(K, 1)) / chunk * chunk;
  return std::min(M, std::max(chunk, fit));
}

// The task order of every packed GEMM here (fp32, bf16, AMX, int8): fn(group, m_begin, m_end) for each column
// group (a weight panel: one column block, or neighbouring ones) times each row chunk (balanced_row_chunk of
// `tile` and `max_rows`), span of cached_rows rows after span, column-major within a span: static scheduling
// gives each thread its own columns, so a panel is read by one thread, once per span, and stays in cache across
// the span's row chunks (row-major tasks had every thread stream every panel from memory). Orphaned work sharing
// (call it from every thread of a parallel region, or from one thread); ends with the team's barrier.
template <class Fn>
inline void gemm_tasks(int64_t M, int64_t K, int64_t groups, int64_t tile, int64_t max_rows, Fn&& fn) {
  const int64_t rows_cached = cached_rows(M, K, balanced_row_chunk(M, tile, max_rows));
  for (int64_t s0 = 0; s0 < M; s0 += rows_cached) {
    const int64_t s1 = std::min(M, s0 + rows_cached), chunk = balanced_row_chunk(s1 - s0, tile, max_rows);
    const int64_t chunks = (s1 - s0 + chunk - 1) / chunk;
#pragma omp for schedule(static) nowait
    for (int64_t task = 0; task < chunks * groups; ++task) {
      const int64_t m_begin = s0 + (task % chunks) * chunk;
      fn(task / chunks, m_begin, std::min(s1, m_begin + chunk));
    }
  }
#pragma omp barrier
}

// out[M, N] (row stride ldo) = a[M, K] (row stride lda) times the packed weight's transpose, plus bias[N]
// when given, then plus add[M, N] (row stride ldadd; it may be `out` itself) when given. Orphaned work
// sharing over gemm_tasks: one column block a task, or two neighbouring ones where the ISA has the registers.
// The tiles prefetch the next panel as they stream theirs (a thread's next task is the next panel or the same).
void gemm_packed(const float* a, int64_t lda, int64_t M, int64_t K, const float* packed, int64_t N,
                 const float* bias, const float* add, int64_t ldadd, float* out, int64_t ldo) {
  const int64_t blocks = (N + kNB - 1) / kNB;
  // Pairs of blocks from 16 rows: half the weight loads per FMA, 12 rows a tile (30 cold SmolLM2 layers, 2 threads,
  // bench_packed_linears.py --native: 20 rows 32.0 -> 28.7 ms, 32 rows 42.6 -> 36.4, 512 rows 404 -> 383 against
  // 12 x 16 tiles, resp. 8 x 32 from 36 rows); below 16 rows as fast either way.
  const int64_t span = kPairs && M >= 16 ? 2 : 1;
  gemm_tasks(M, K, (blocks + span - 1) / span, span == 2 ? kMR2 : kMR, 96, [&](int64_t group, int64_t m_begin,
                                                                              int64_t m_end) {
    const int64_t nb = group * span, n0 = nb * kNB;
    const float* b = bias ? bias + n0 : nullptr;
#if defined(__AVX512F__)
    if (span == 2 && nb + 1 < blocks) {
      const int cols1 = static_cast<int>(std::min<int64_t>(kNB, N - n0 - kNB));
      for (int64_t m0 = m_begin; m0 < m_end; m0 += kMR2) {
        const int rows = static_cast<int>(std::min<int64_t>(kMR2, m_end - m0));
        tile2_rows<kMR2>(rows, a + m0 * lda, lda, K, packed + nb * K * kNB, packed + (nb + 1) * K * kNB, b,
                         add ? add + m0 * ldadd + n0 : nullptr, ldadd, out + m0 * ldo + n0, ldo, cols1);
      }
      return;
    }
#endif
    const int cols = static_cast<int>(std::min<int64_t>(kNB, N - n0));
    for (int64_t m0 = m_begin; m0 < m_end; m0 += kMR) {
      const int rows = static_cast<int>(std::min<int64_t>(kMR, m_end - m0));
      tile_rows<kMR>(rows, a + m0 * lda, lda, K, packed + nb * K * kNB, b, add ? add + m0 * ldadd + n0 : nullptr,
                     ldadd, out + m0 * ldo + n0, ldo, cols);
    }
  });
}

}  // namespace
