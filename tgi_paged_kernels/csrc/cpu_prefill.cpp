// Prefill attention over the paged pool (CPU, fp32 queries): every request's new tokens against its cached
// prefix and themselves, in one call for the whole step (torch reference:
// reference.paged_prefill_attention_reference; compared in tests/kernels/test_cpu_prefill.py). Built into the same library
// as cpu_kernels.cpp (cpu_native.py).
//
// One task per (request, KV head): the request's visible keys and values are read once from their blocks
// (any pool dtype, decoded to fp32) into the packed layout of cpu_gemm.h, then for each query head of the
// group and each tile of query rows: scores = q K^T by the packed GEMM over the key blocks the tile can see
// (causal: none past its last row), scale, soft-cap, causal and window masks, softmax (a sink joins the
// denominator), and out = p V by the same GEMM. With per-row key limits (bidirectional spans: a row sees keys up
// to its limit, not only up to itself) the tile reads keys up to its rows' largest limit.

#include "cpu_gemm.h"

namespace {

struct PrefillArgs {
  const float* query;
  int64_t q_st, q_sh;  // element strides of query [T, Hq, D] (token, head); head_dim contiguous
  const char* k_cache;
  const char* v_cache;
  const float* lut;
  int64_t c_sblock, c_sslot, c_shead, num_blocks;
  const void* block_tables;
  int bt_int64;
  int64_t bt_stride, bt_width;
  const void* query_start_loc;
  int qsl_int64;
  const void* seq_lens;
  int sl_int64;
  float* out;  // [T, Hq, D] contiguous
  int64_t num_tokens;
  int num_requests, num_q_heads, num_kv_heads, head_dim, block_size;
  float scale, softcap;
  int window;
  const float* sinks;
  float k_scale, v_scale;
  const int64_t* limits;  // [T] last key position of each query row (>= its position, < seq_len), or null: causal
};

constexpr int kBadQueries = 4;  // query_start_loc not rising within [0, T], or more queries than seq_len
constexpr int kBadLimits = 5;   // a row's key limit before its own position or at/after its seq_len

struct PrefillScratch {
  std::vector<float> keys, values, scores, row;
};

template <int kDtype>
int prefill_task(const PrefillArgs& a, int b, int h, PrefillScratch& s) {
  constexpr int64_t bytes = kDtype == 0 ? 4 : (kDtype == 1 ? 2 : 1);
  const int D = a.head_dim, bs = a.block_size, group = a.num_q_heads / a.num_kv_heads;
  const int64_t q0 = read_index(a.query_start_loc, a.qsl_int64, b), q1 = read_index(a.query_start_loc, a.qsl_int64, b + 1);
  const int64_t nq = q1 - q0, len = read_index(a.seq_lens, a.sl_int64, b);
  if (q0 < 0 || nq < 0 || q1 > a.num_tokens || nq > len) return kBadQueries;
  if (nq == 0) return kOk;
  if (len > a.bt_width * bs) return kTableTooNarrow;
  const int64_t first = len - nq;  // position of the first query
  if (a.limits)
    for (int64_t r = 0; r < nq; ++r)
      if (a.limits[q0 + r] < first + r || a.limits[q0 + r] >= len) return kBadLimits;
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, first - a.window + 1) : 0;  // first key any query sees
  const int64_t n = len - lo, n_pad = (n + kNB - 1) / kNB * kNB;
  for (int64_t col = lo / bs; col < (len + bs - 1) / bs; ++col) {
    const int64_t blk = read_index(a.block_tables, a.bt_int64, b * a.bt_stride + col);
    if (blk < 0 || blk >= a.num_blocks) return kBlockOutOfRange;
  }
  // Keys packed as a [n, D] weight ([n_pad / 16][D][16]); values as a [D, n] one ([D / 16][n_pad][16]).
  s.keys.assign(static_cast<size_t>(n_pad) * D, 0.0f);
  s.values.assign(static_cast<size_t>((D + kNB - 1) / kNB * kNB) * n_pad, 0.0f);
  s.row.resize(D);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = lo + i, blk = read_index(a.block_tables, a.bt_int64, b * a.bt_stride + pos / bs);
    const int64_t off = (blk * a.c_sblock + (pos % bs) * a.c_sslot + static_cast<int64_t>(h) * a.c_shead) * bytes;
    const float* k = row_f32<kDtype>(a.k_cache + off, a.lut, a.k_scale, D, s.row.data());
    float* kp = s.keys.data() + (i / kNB) * D * kNB + i % kNB;
    for (int d = 0; d < D; ++d) kp[d * kNB] = k[d];
    const float* v = row_f32<kDtype>(a.v_cache + off, a.lut, a.v_scale, D, s.row.data());
    for (int d = 0; d < D; ++d) s.values[((d / kNB) * n_pad + i) * kNB + d % kNB] = v[d];
  }
  s.scores.resize(static_cast<size_t>(kMR) * n_pad);
  for (int g = 0; g < group; ++g) {
    const int j = h * group + g;  // query head
    const float sink = a.sinks ? a.sinks[j] : -INFINITY;
    for (int64_t r0 = 0; r0 < nq; r0 += kMR) {
      const int rows = static_cast<int>(std::min<int64_t>(kMR, nq - r0));
      const float* q = a.query + (q0 + r0) * a.q_st + static_cast<int64_t>(j) * a.q_sh;
      int64_t reach = first + r0 + rows - 1;  // the last key some row of the tile sees
      if (a.limits)
        for (int r = 0; r < rows; ++r) reach = std::max(reach, a.limits[q0 + r0 + r]);
      const int64_t seen = reach + 1 - lo;  // keys [0, seen) are visible to some row of the tile
      const int64_t seen_pad = (seen + kNB - 1) / kNB * kNB;
      float* sc = s.scores.data();
      for (int64_t i0 = 0; i0 < seen_pad; i0 += kNB)
        tile_rows<kMR>(rows, q, a.q_st, D, s.keys.data() + (i0 / kNB) * D * kNB, nullptr, nullptr, 0, sc + i0, n_pad,
                       kNB);
      for (int r = 0; r < rows; ++r) {
        float* sr = sc + r * n_pad;
        const int64_t p = first + r0 + r;  // this row's position: keys lo..its limit, the window before p
        const int64_t limit = a.limits ? a.limits[q0 + r0 + r] : p;
        const int64_t vis_lo = (a.window > 0 ? std::max<int64_t>(lo, p - a.window + 1) : lo) - lo;
        const int64_t vis_hi = limit - lo + 1;
        float peak = sink;
        for (int64_t i = 0; i < seen_pad; ++i) {
          float x = sr[i] * a.scale;
          if (a.softcap > 0.0f) x = std::tanh(x / a.softcap) * a.softcap;
          sr[i] = (i >= vis_lo && i < vis_hi) ? x : -INFINITY;
          peak = std::max(peak, sr[i]);
        }
        float total = a.sinks ? exp_nonpositive(sink - peak) : 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < seen_pad; ++i) {
          const float e = sr[i] == -INFINITY ? 0.0f : exp_nonpositive(sr[i] - peak);
          sr[i] = e;
          total += e;
        }
        const float inv = 1.0f / total;
#pragma omp simd
        for (int64_t i = 0; i < seen_pad; ++i) sr[i] *= inv;
      }
      float* o = a.out + ((q0 + r0) * a.num_q_heads + j) * static_cast<int64_t>(D);
      for (int d0 = 0; d0 < D; d0 += kNB)
        tile_rows<kMR>(rows, sc, n_pad, seen_pad, s.values.data() + (d0 / kNB) * n_pad * kNB, nullptr, nullptr, 0,
                       o + d0, static_cast<int64_t>(a.num_q_heads) * D, std::min(kNB, D - d0));
    }
  }
  return kOk;
}

template <int kDtype>
int prefill_all(const PrefillArgs& a, int num_threads) {
  const int tasks = a.num_requests * a.num_kv_heads;
  int status = kOk;
#pragma omp parallel num_threads(num_threads)
  {
    PrefillScratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < tasks; ++task) {
      const int code = prefill_task<kDtype>(a, task / a.num_kv_heads, task % a.num_kv_heads, scratch);
      if (code != kOk) {
#pragma omp atomic write
        status = code;
      }
    }
  }
  return status;
}

}  // namespace

extern "C" {

// Causal attention of every request's new tokens over its paged K/V (already stored): request b's queries
// are rows query_start_loc[b]..query_start_loc[b+1] of query fp32 [T, Hq, D] (element strides q_st, q_sh;
// head_dim contiguous), at positions seq_lens[b] - q_len .. seq_lens[b] - 1; pools [num_blocks, block_size,
// Hkv, D] (strides c_sblock, c_sslot, c_shead; storage dtype codes as cpu_kernels.cpp); block_tables [B, *]
// (row stride bt_stride); query_start_loc [B + 1], seq_lens [B] (int32 or int64); out fp32 [T, Hq, D]
// contiguous (T = num_tokens rows). window <= 0: full attention; softcap <= 0: none; sinks fp32 [Hq] or null;
// limits int64 [T] (the last key position each row sees, from its own position to seq_len - 1) or null: causal.
// Returns 0; 5 for a limit outside its row's [position, seq_len); 1 for a
// bad dtype code, 2 when a seq_len needs more blocks than the table's width, 3 for a block id outside
// [0, num_blocks), 4 for query_start_loc not rising within [0, T] or more queries than seq_len (nothing outside the table
// or the pool is read; the output is then undefined).
int tgi_paged_prefill_attention(
    const float* query, int64_t q_st, int64_t q_sh,
    const void* k_cache, const void* v_cache, int cache_dtype, const float* lut,
    int64_t num_blocks, int64_t c_sblock, int64_t c_sslot, int64_t c_shead,
    const void* block_tables, int bt_int64, int64_t bt_stride, int64_t bt_width,
    const void* query_start_loc, int qsl_int64, const void* seq_lens, int sl_int64,
    float* out, int64_t num_tokens, int num_requests, int num_q_heads, int num_kv_heads, int head_dim,
    int block_size, float scale, float softcap, int window, const float* sinks, float k_scale, float v_scale,
    const int64_t* limits, int num_threads) {
  const PrefillArgs a{query, q_st, q_sh, static_cast<const char*>(k_cache), static_cast<const char*>(v_cache), lut,
                      c_sblock, c_sslot, c_shead, num_blocks, block_tables, bt_int64, bt_stride, bt_width,
                      query_start_loc, qsl_int64, seq_lens, sl_int64, out, num_tokens, num_requests, num_q_heads,
                      num_kv_heads,
                      head_dim, block_size, scale, softcap, window, sinks, k_scale, v_scale, limits};
  switch (cache_dtype) {
    case 0: return prefill_all<0>(a, num_threads);
    case 1: return prefill_all<1>(a, num_threads);
    case 2: return prefill_all<2>(a, num_threads);
    default: return kBadDtype;
  }
}

}  // extern "C"
