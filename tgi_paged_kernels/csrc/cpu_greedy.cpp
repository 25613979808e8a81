// The greedy choice over a step's logits, one pass for the maximum and one for the softmax denominator (torch
// reference: tgi_paged_kernels.cpu_greedy.greedy_pick_ref). It replaces torch's argmax plus a full
// log_softmax, which writes a [rows, vocab] tensor to read one value per row back.

#include "cpu_common.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kScan = 64;  // values per block of the first-index scan

// The largest non-NaN value of x[0, n) (-inf when there is none), and whether a NaN is among them. Written with
// intrinsics: GCC leaves a max reduction over floats scalar (see row_max in cpu_common.h).
inline float max_and_nan(const float* x, int64_t n, bool* has_nan) {
  float m = -INFINITY;
  bool any = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 peak = _mm512_set1_ps(-INFINITY);
  __mmask16 bad = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    peak = _mm512_max_ps(v, peak);  // a NaN in v keeps peak: skipped here, flagged below
    bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  m = _mm512_reduce_max_ps(peak);
  any = bad != 0;
#elif defined(__AVX2__)
  __m256 peak = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    peak = _mm256_max_ps(v, peak);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, peak);
  for (float v : lanes) m = std::max(m, v);
  any = _mm256_movemask_ps(bad) != 0;
#endif
  for (; i < n; ++i) {
    m = x[i] > m ? x[i] : m;
    any = any || x[i] != x[i];
  }
  *has_nan = any;
  return m;
}

// The first i with x[i] == m (or, with `nan`, the first NaN): blocks of kScan values are tested whole, the one
// that holds it value by value.
inline int64_t first_index(const float* x, int64_t n, float m, bool nan) {
  int64_t i = 0;
  for (; i + kScan <= n; i += kScan) {
    int hit = 0;
    if (nan) {
#pragma omp simd reduction(| : hit)
      for (int64_t j = 0; j < kScan; ++j) hit |= x[i + j] != x[i + j];
    } else {
#pragma omp simd reduction(| : hit)
      for (int64_t j = 0; j < kScan; ++j) hit |= x[i + j] == m;
    }
    if (hit) break;
  }
  for (; i < n; ++i) {
    if (nan ? x[i] != x[i] : x[i] == m) return i;
  }
  return 0;  // not reached: m is a value of the row, or the row holds a NaN
}

}  // namespace

extern "C" {

// For each of `rows` rows of `vocab` fp32 logits (row stride `row_stride`, values contiguous): ids[r] = the row's
// first maximum, or its first NaN when it has one (torch.argmax's choice); logprobs[r] = log_softmax of the row
// at ids[r], that is -log(sum_j exp(x_j - max)) (the chosen value's own term is exp(0) = 1), summed in 16 lanes
// with the softmax exp of cpu_common.h (a few ulp from torch's order); NaN where torch's log_softmax is NaN (a
// NaN in the row, or a maximum of +inf or -inf). Rows are split across `num_threads` threads. Returns 0; 1 when
// vocab < 1.
int tgi_paged_greedy_pick(const float* scores, int64_t rows, int64_t vocab, int64_t row_stride, int64_t* ids,
                          float* logprobs, int num_threads) {
  if (vocab < 1) return 1;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, rows)));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = scores + r * row_stride;
    bool nan = false;
    const float m = max_and_nan(x, vocab, &nan);
    ids[r] = first_index(x, vocab, m, nan);
    if (nan || !std::isfinite(m)) {
      logprobs[r] = NAN;
      continue;
    }
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < vocab; ++j) total += exp_nonpositive(x[j] - m);
    logprobs[r] = -std::log(total);
  }
  return 0;
}

}  // extern "C"
