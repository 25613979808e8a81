// Prefill attention over the paged pool (CPU, fp32 queries): every request's new tokens against its cached
// prefix and themselves, in one call for the whole step (torch reference:
// reference.paged_prefill_attention_reference; compared in tests/kernels/test_cpu_prefill.py). Built into the same library
// as cpu_kernels.cpp (cpu_native.py).
//
// Per (request, KV head) pair, the request's visible keys and values are read once from their blocks (any pool
// dtype, decoded to fp32) into the packed layout of cpu_gemm.h, then for each query head of the group and each
// tile of query rows: scores = q K^T by the packed GEMM over the key blocks the tile can see
// (causal: none past its last row), scale, soft-cap, causal and window masks, softmax (a sink joins the
// denominator), and out = p V by the same GEMM (on AVX-512 two key blocks, or two blocks of V's columns, per
// register tile: tile2 of cpu_gemm.h, the same sums). With per-row key limits (bidirectional spans: a row sees keys up
// to its limit, not only up to itself) the tile reads keys up to its rows' largest limit. Many pairs: one task each;
// few (a long prompt alone): each pair's query rows cut into ranges, a task each (prefill_tasks).

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

// One (request, KV head) pair's geometry: its queries [q0, q0 + nq) at positions first.., the keys [lo, len)
// any of them sees (n of them, padded to n_pad for the packed GEMM).
struct PairView {
  int64_t q0 = 0, nq = 0, len = 0, first = 0, lo = 0, n = 0, n_pad = 0;
};

// The view of request b, or an error code (nothing outside the table or the pool is read past it).
inline int pair_view(const PrefillArgs& a, int b, PairView& v) {
  const int bs = a.block_size;
  v.q0 = read_index(a.query_start_loc, a.qsl_int64, b);
  const int64_t q1 = read_index(a.query_start_loc, a.qsl_int64, b + 1);
  v.nq = q1 - v.q0, v.len = read_index(a.seq_lens, a.sl_int64, b);
  if (v.q0 < 0 || v.nq < 0 || q1 > a.num_tokens || v.nq > v.len) return kBadQueries;
  if (v.nq == 0) return kOk;
  if (v.len > a.bt_width * bs) return kTableTooNarrow;
  v.first = v.len - v.nq;
  if (a.limits)
    for (int64_t r = 0; r < v.nq; ++r)
      if (a.limits[v.q0 + r] < v.first + r || a.limits[v.q0 + r] >= v.len) return kBadLimits;
  v.lo = a.window > 0 ? std::max<int64_t>(0, v.first - a.window + 1) : 0;
  v.n = v.len - v.lo, v.n_pad = (v.n + kNB - 1) / kNB * kNB;
  for (int64_t col = v.lo / bs; col < (v.len + bs - 1) / bs; ++col) {
    const int64_t blk = read_index(a.block_tables, a.bt_int64, b * a.bt_stride + col);
    if (blk < 0 || blk >= a.num_blocks) return kBlockOutOfRange;
  }
  return kOk;
}

// Keys packed as a [n, D] weight ([n_pad / 16][D][16]); values as a [D, n] one ([D / 16][n_pad][16]).
struct PackedKv {
  std::vector<float> keys, values;
  void reset(const PairView& v, int D) {
    keys.assign(static_cast<size_t>(v.n_pad) * D, 0.0f);
    values.assign(static_cast<size_t>((D + kNB - 1) / kNB * kNB) * v.n_pad, 0.0f);
  }
};

// Keys [i0, i1) of the view (relative to lo) of request b, KV head h, into `kv` (row: D floats of scratch).
template <int kDtype>
void pack_keys(const PrefillArgs& a, int b, int h, const PairView& v, int64_t i0, int64_t i1, PackedKv& kv,
               float* row) {
  constexpr int64_t bytes = kDtype == 0 ? 4 : (kDtype == 1 ? 2 : 1);
  const int D = a.head_dim, bs = a.block_size;
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t pos = v.lo + i, blk = read_index(a.block_tables, a.bt_int64, b * a.bt_stride + pos / bs);
    const int64_t off = (blk * a.c_sblock + (pos % bs) * a.c_sslot + static_cast<int64_t>(h) * a.c_shead) * bytes;
    const float* k = row_f32<kDtype>(a.k_cache + off, a.lut, a.k_scale, D, row);
    float* kp = kv.keys.data() + (i / kNB) * D * kNB + i % kNB;
    for (int d = 0; d < D; ++d) kp[d * kNB] = k[d];
    const float* val = row_f32<kDtype>(a.v_cache + off, a.lut, a.v_scale, D, row);
    for (int d = 0; d < D; ++d) kv.values[((d / kNB) * v.n_pad + i) * kNB + d % kNB] = val[d];
  }
}

// Query head j's rows [r0, r0 + kMR) of the view (clipped to nq) against the packed keys and values: scores by
// the packed GEMM over the key blocks the tile can see, masks and softmax, out = p V. `scores`: kMR * n_pad.
inline void attend_tile(const PrefillArgs& a, const PairView& v, int j, int64_t r0, const PackedKv& kv,
                        float* scores) {
  const int D = a.head_dim;
  const float sink = a.sinks ? a.sinks[j] : -INFINITY;
  const int rows = static_cast<int>(std::min<int64_t>(kMR, v.nq - r0));
  const float* q = a.query + (v.q0 + r0) * a.q_st + static_cast<int64_t>(j) * a.q_sh;
  int64_t reach = v.first + r0 + rows - 1;  // the last key some row of the tile sees
  if (a.limits)
    for (int r = 0; r < rows; ++r) reach = std::max(reach, a.limits[v.q0 + r0 + r]);
  const int64_t seen = reach + 1 - v.lo;  // keys [0, seen) are visible to some row of the tile
  const int64_t seen_pad = (seen + kNB - 1) / kNB * kNB;
  // Two key blocks at a time where the ISA has the registers (one broadcast of q per two FMAs; the same bits).
  int64_t i0 = 0;
#if defined(__AVX512F__)
  for (; i0 + 2 * kNB <= seen_pad; i0 += 2 * kNB) {
    const float* k0 = kv.keys.data() + (i0 / kNB) * D * kNB;
    tile2_rows<kMR2>(rows, q, a.q_st, D, k0, k0 + D * kNB, nullptr, nullptr, 0, scores + i0, v.n_pad, kNB);
  }
#endif
  for (; i0 < seen_pad; i0 += kNB)
    tile_rows<kMR>(rows, q, a.q_st, D, kv.keys.data() + (i0 / kNB) * D * kNB, nullptr, nullptr, 0, scores + i0,
                   v.n_pad, kNB);
  for (int r = 0; r < rows; ++r) {
    float* sr = scores + r * v.n_pad;
    const int64_t p = v.first + r0 + r;  // this row's position: keys lo..its limit, the window before p
    const int64_t limit = a.limits ? a.limits[v.q0 + r0 + r] : p;
    const int64_t vis_lo = (a.window > 0 ? std::max<int64_t>(v.lo, p - a.window + 1) : v.lo) - v.lo;
    const int64_t vis_hi = limit - v.lo + 1;
    // Vectorized passes over the visible keys only (scale and soft-cap, max, exp, normalization); the tile's
    // other columns get weight 0.
    if (a.softcap > 0.0f) {
      for (int64_t i = vis_lo; i < vis_hi; ++i) sr[i] = std::tanh(sr[i] * a.scale / a.softcap) * a.softcap;
    } else {
#pragma omp simd
      for (int64_t i = vis_lo; i < vis_hi; ++i) sr[i] *= a.scale;
    }
    const float peak = row_max(sr + vis_lo, vis_hi - vis_lo, sink);
    float total = a.sinks ? exp_nonpositive(sink - peak) : 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = vis_lo; i < vis_hi; ++i) {
      const float e = exp_nonpositive(sr[i] - peak);
      sr[i] = e;
      total += e;
    }
    const float inv = 1.0f / total;
    std::fill(sr, sr + vis_lo, 0.0f);
#pragma omp simd
    for (int64_t i = vis_lo; i < vis_hi; ++i) sr[i] *= inv;
    std::fill(sr + vis_hi, sr + seen_pad, 0.0f);
  }
  float* o = a.out + ((v.q0 + r0) * a.num_q_heads + j) * static_cast<int64_t>(D);
  const int64_t ldo = static_cast<int64_t>(a.num_q_heads) * D;
  int d0 = 0;
#if defined(__AVX512F__)
  for (; d0 + kNB < D; d0 += 2 * kNB) {  // two column blocks of V (the second may be short)
    const float* v0 = kv.values.data() + (d0 / kNB) * v.n_pad * kNB;
    tile2_rows<kMR2>(rows, scores, v.n_pad, seen_pad, v0, v0 + v.n_pad * kNB, nullptr, nullptr, 0, o + d0, ldo,
                     std::min(kNB, D - d0 - kNB));
  }
#endif
  for (; d0 < D; d0 += kNB)
    tile_rows<kMR>(rows, scores, v.n_pad, seen_pad, kv.values.data() + (d0 / kNB) * v.n_pad * kNB, nullptr,
                   nullptr, 0, o + d0, ldo, std::min(kNB, D - d0));
}

// A task: rows [r_begin, r_end) of request b's queries for KV head h's query heads.
struct PrefillTask {
  int b, h;
  int64_t r_begin, r_end;
};

// The step's tasks: each (request, KV head) pair whole, or, when pairs are fewer than 4 per thread (one long
// prompt has as many pairs as KV heads), cut into row ranges of whole tiles so every thread gets work; later
// ranges (more keys under the causal mask) first.
inline std::vector<PrefillTask> prefill_tasks(const PrefillArgs& a, int num_threads) {
  const int pairs = a.num_requests * a.num_kv_heads;
  const int64_t cuts = std::max<int64_t>(1, (4 * num_threads + pairs - 1) / pairs);
  std::vector<PrefillTask> tasks;
  for (int64_t c = cuts - 1; c >= 0; --c)
    for (int pair = 0; pair < pairs; ++pair) {
      const int b = pair / a.num_kv_heads;
      const int64_t nq = read_index(a.query_start_loc, a.qsl_int64, b + 1) - read_index(a.query_start_loc, a.qsl_int64, b);
      const int64_t tiles = (std::max<int64_t>(nq, 0) + kMR - 1) / kMR, per = (tiles + cuts - 1) / cuts;
      const int64_t r_begin = std::min(tiles, c * per) * kMR, r_end = std::min(tiles, (c + 1) * per) * kMR;
      if (c == 0 || r_begin < r_end) tasks.push_back({b, pair % a.num_kv_heads, r_begin, r_end});
    }
  return tasks;
}

// One task: its pair's keys up to what its last rows see packed into the thread's scratch, then its tiles.
template <int kDtype>
int run_task(const PrefillArgs& a, const PrefillTask& t, PackedKv& kv, std::vector<float>& scores, float* row) {
  PairView v;
  const int code = pair_view(a, t.b, v);
  if (code != kOk || v.nq == 0 || t.r_begin >= v.nq) return code;
  const int64_t r_end = std::min(t.r_end, v.nq);
  int64_t reach = v.first + r_end - 1;
  if (a.limits)
    for (int64_t r = t.r_begin; r < r_end; ++r) reach = std::max(reach, a.limits[v.q0 + r]);
  kv.reset(v, a.head_dim);
  pack_keys<kDtype>(a, t.b, t.h, v, 0, reach + 1 - v.lo, kv, row);
  scores.resize(static_cast<size_t>(kMR) * v.n_pad);
  const int group = a.num_q_heads / a.num_kv_heads;
  for (int g = 0; g < group; ++g)
    for (int64_t r0 = t.r_begin; r0 < r_end; r0 += kMR) attend_tile(a, v, t.h * group + g, r0, kv, scores.data());
  return kOk;
}

template <int kDtype>
int prefill_all(const PrefillArgs& a, int num_threads) {
  int status = kOk;
  const std::vector<PrefillTask> tasks = prefill_tasks(a, num_threads);
#pragma omp parallel num_threads(num_threads)
  {
    PackedKv kv;
    std::vector<float> scores, row(a.head_dim);
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < tasks.size(); ++i) {
      const int code = run_task<kDtype>(a, tasks[i], kv, scores, row.data());
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
