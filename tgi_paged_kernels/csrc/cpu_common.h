// Shared helpers of the CPU kernels (cpu_kernels.cpp, cpu_layer.cpp): bf16 conversions, the softmax exp,
// the paged decode attention of one request, and fp32 row helpers. Internal linkage: each source
// compiled into the library gets its own copy.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t nan = (bits >> 16) | 0x40u;  // a select, not a branch: loops over it vectorize
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

// v rounded to bf16 and back: where a torch bf16 op would store its result.
inline float round_bf16(float v) { return bf16_to_float(float_to_bf16(v)); }

// exp(x) for x <= 0 (softmax terms), in a form the compiler vectorizes (glibc's expf is a scalar call):
// Cody-Waite reduction x = n ln2 + r and Cephes' degree-6 polynomial for exp(r), within ~2 ulp of
// expf. Inputs below -87.3 give ~1e-38 instead of a denormal or 0 (a weight nobody can see).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.3f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Row `src` of `n` values in storage dtype kDtype as fp32: the row itself for fp32, else decoded into
// `buf` (times `scale` for the one-byte formats).
template <int kDtype>
inline const float* row_f32(const char* src, const float* lut, float scale, int n, float* buf) {
  if constexpr (kDtype == 0) {
    return reinterpret_cast<const float*>(src);
  } else if constexpr (kDtype == 1) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    for (int i = 0; i < n; ++i) buf[i] = bf16_to_float(s[i]);
    return buf;
  } else {
    const uint8_t* s = reinterpret_cast<const uint8_t*>(src);
    for (int i = 0; i < n; ++i) buf[i] = lut[s[i]] * scale;
    return buf;
  }
}

inline int64_t read_index(const void* base, int is_int64, int64_t i) {
  return is_int64 ? static_cast<const int64_t*>(base)[i] : static_cast<const int32_t*>(base)[i];
}

// Ask for the `rows` rows of one head in a pool block ahead of use: they are strided (the other heads
// sit between them) and blocks are scattered, which the hardware prefetcher does not follow.
inline void prefetch_rows(const char* first, int rows, int64_t stride_bytes, int64_t row_bytes) {
  for (int r = 0; r < rows; ++r)
    for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(first + r * stride_bytes + off);
}

struct DecodeArgs {
  const float* query;
  int64_t q_sb, q_sh;
  const char* k_cache;
  const char* v_cache;
  const float* lut;
  int64_t c_sblock, c_sslot, c_shead;  // element strides
  int64_t num_blocks;  // pool rows: block ids must lie in [0, num_blocks)
  const void* block_tables;
  int bt_int64;
  int64_t bt_stride, bt_width;
  const void* seq_lens;
  int sl_int64;
  float* out;
  int num_requests, num_q_heads, num_kv_heads, head_dim, block_size;
  float scale, softcap;
  int window;
  const float* sinks;
  float k_scale, v_scale;
  int v_head_dim;  // <= head_dim: V rows (read with K's strides) and output rows are this wide (a latent cache)
  // Several query rows per request (a speculative verify step): query row b belongs to request row_request[b]
  // (its block table row) and sees that request's first row_len[b] positions (causal over its new tokens).
  // Null: row b is request b, which sees its seq_lens[b] positions.
  const int64_t* row_request = nullptr;
  const int64_t* row_len = nullptr;
};

constexpr int kOk = 0, kBadDtype = 1, kTableTooNarrow = 2, kBlockOutOfRange = 3;

// Each query row's request and visible length when requests have several new tokens (query_start_loc [B + 1]
// int32): row t of request b (rows qsl[b] .. qsl[b + 1]) sees seq_lens[b] - (qsl[b + 1] - 1 - t) positions, its
// own included. False for a query_start_loc that does not describe T rows, or a row that would see nothing.
inline bool query_rows(const int32_t* qsl, int64_t B, int64_t T, const void* seq_lens, int sl_int64,
                       std::vector<int64_t>& row_request, std::vector<int64_t>& row_len) {
  if (qsl[0] != 0 || qsl[B] != T) return false;
  row_request.resize(T);
  row_len.resize(T);
  for (int64_t b = 0; b < B; ++b) {
    if (qsl[b + 1] < qsl[b]) return false;
    const int64_t len = read_index(seq_lens, sl_int64, b);
    for (int64_t t = qsl[b]; t < qsl[b + 1]; ++t) {
      row_request[t] = b;
      row_len[t] = len - (qsl[b + 1] - 1 - t);
      if (row_len[t] < 1) return false;
    }
  }
  return true;
}


// max(init, x[0], ..., x[n - 1]), NaNs in x skipped (std::max(peak, x[i]) in a loop), 16 lanes at a time: GCC
// leaves `omp simd reduction(max)` over floats scalar (a 4-cycle chain per value; a fifth of the prefill
// attention's time).
inline float row_max(const float* x, int64_t n, float init) {
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 peak = _mm512_set1_ps(init);
  for (; i + 16 <= n; i += 16) peak = _mm512_max_ps(_mm512_loadu_ps(x + i), peak);  // NaN in x: keeps peak
  init = _mm512_reduce_max_ps(peak);
#endif
  for (; i < n; ++i) init = std::max(init, x[i]);
  return init;
}

#if defined(__AVX512F__)
// 16 values c * 16 .. c * 16 + 15 of a K or V row in storage dtype kDtype (0 fp32, 1 bf16) as fp32.
template <int kDtype>
inline __m512 row16(const char* row, int c) {
  if constexpr (kDtype == 0) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + 16 * c);
  } else {
    const uint16_t* values = reinterpret_cast<const uint16_t*>(row) + 16 * c;
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}
#endif

// One request's KV heads [h0, h1) and the query heads sharing them. Rows are visited in pool order (block,
// slot, head), so a request's whole row of heads is read contiguously when one task holds every head.
// kHeadDim 0: runtime head_dim and v_head_dim (> 0: both are kHeadDim). Returns kOk, or an error code before reading outside the table or the pool.
template <int kDtype, int kHeadDim>
int decode_heads(const DecodeArgs& a, int b, int h0, int h1, std::vector<float>& scores, float* buf, float* acc) {
  constexpr int64_t bytes = kDtype == 0 ? 4 : (kDtype == 1 ? 2 : 1);
  const int D = kHeadDim > 0 ? kHeadDim : a.head_dim;
  const int Dv = kHeadDim > 0 ? kHeadDim : a.v_head_dim;  // dispatch templates only V as wide as K
  const int group = a.num_q_heads / a.num_kv_heads;
  const int rows_q = (h1 - h0) * group;  // query heads of this task; query head j = h0 * group + j
  const int bs = a.block_size;
  const int64_t req = a.row_request ? a.row_request[b] : b;
  const int64_t len = a.row_len ? a.row_len[b] : read_index(a.seq_lens, a.sl_int64, b);
  const int64_t start = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
  const int64_t n = len - start;
  const float* q = a.query + b * a.q_sb + static_cast<int64_t>(h0) * group * a.q_sh;
  float* o = a.out + (static_cast<int64_t>(b) * a.num_q_heads + static_cast<int64_t>(h0) * group) * Dv;
  if (n <= 0) {
    std::fill(o, o + static_cast<int64_t>(rows_q) * Dv, 0.0f);
    return kOk;
  }
  if (len > a.bt_width * bs) return kTableTooNarrow;
  const int64_t first_col = start / bs, end_col = (len + bs - 1) / bs;
  for (int64_t col = first_col; col < end_col; ++col) {
    const int64_t blk = read_index(a.block_tables, a.bt_int64, req * a.bt_stride + col);
    if (blk < 0 || blk >= a.num_blocks) return kBlockOutOfRange;
  }
  scores.resize(static_cast<size_t>(n) * rows_q);
  const int64_t slot_bytes = a.c_sslot * bytes, head_bytes = a.c_shead * bytes, row_bytes = D * bytes;
  const int64_t span_bytes = (h1 - h0 - 1) * head_bytes + row_bytes;  // one slot's heads h0..h1-1
  auto block_base = [&](const char* cache, int64_t col) {
    const int64_t blk = read_index(a.block_tables, a.bt_int64, req * a.bt_stride + col);
    return cache + (blk * a.c_sblock + static_cast<int64_t>(h0) * a.c_shead) * bytes;
  };
  // Visits positions [start, len) block by block: fn(row of head h0 at that position, i = position - start).
  // The next block's slots are prefetched one per slot visited here: asked all at once, they filled the
  // line-fill buffers and the prefetches stalled the core (half of this function's time, SmolLM2 decode).
  auto for_each_slot = [&](const char* cache, auto&& fn) {
    const char* base = block_base(cache, first_col);
    for (int64_t col = first_col; col < end_col; ++col) {
      const char* next = col + 1 < end_col ? block_base(cache, col + 1) : nullptr;
      const int64_t s0 = std::max<int64_t>(start - col * bs, 0), s1 = std::min<int64_t>(len - col * bs, bs);
      for (int64_t s = s0; s < s1; ++s) {
        if (next) prefetch_rows(next + (s - s0) * slot_bytes, 1, slot_bytes, span_bytes);
        fn(base + s * slot_bytes, col * bs + s - start);
      }
      if (next) prefetch_rows(next + (s1 - s0) * slot_bytes, static_cast<int>(bs - (s1 - s0)), slot_bytes, span_bytes);
      base = next;
    }
  };
#if defined(__AVX512F__)
  // fp32 and bf16 rows of a fixed head_dim: 16 lanes at a time, widened in registers, one reduction per dot.
  constexpr bool kLanes = kDtype <= 1 && kHeadDim > 0 && kHeadDim % 16 == 0;
#else
  constexpr bool kLanes = false;
#endif
  if constexpr (kLanes) {
#if defined(__AVX512F__)
    constexpr int C = kHeadDim / 16;
    for_each_slot(a.k_cache, [&](const char* slot, int64_t i) {
      for (int h = 0; h < h1 - h0; ++h) {
        __m512 k[C];
        for (int c = 0; c < C; ++c) k[c] = row16<kDtype>(slot + h * head_bytes, c);
        for (int g = 0; g < group; ++g) {
          const int j = h * group + g;
          const float* qj = q + j * a.q_sh;
          __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qj), k[0]);
          for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qj + 16 * c), k[c], acc);
          float dot = _mm512_reduce_add_ps(acc) * a.scale;
          if (a.softcap > 0.0f) dot = std::tanh(dot / a.softcap) * a.softcap;
          scores[j * n + i] = dot;
        }
      }
    });
#endif
  } else {
  for_each_slot(a.k_cache, [&](const char* slot, int64_t i) {
    for (int h = 0; h < h1 - h0; ++h) {
      const float* k = row_f32<kDtype>(slot + h * head_bytes, a.lut, a.k_scale, D, buf);
      for (int g = 0; g < group; ++g) {
        const int j = h * group + g;
        const float* qj = q + j * a.q_sh;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < D; ++d) dot += qj[d] * k[d];
        dot *= a.scale;
        if (a.softcap > 0.0f) dot = std::tanh(dot / a.softcap) * a.softcap;
        scores[j * n + i] = dot;
      }
    }
  });
  }
  // Softmax per query head; a sink joins the denominator as a score without a value.
  for (int j = 0; j < rows_q; ++j) {
    float* sj = scores.data() + j * n;
    const float sink = a.sinks ? a.sinks[h0 * group + j] : -INFINITY;
    const float peak = row_max(sj, n, sink);
    float total = a.sinks ? exp_nonpositive(sink - peak) : 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < n; ++i) {
      sj[i] = exp_nonpositive(sj[i] - peak);
      total += sj[i];
    }
    const float inv = 1.0f / total;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) sj[i] *= inv;
  }
  std::fill(acc, acc + static_cast<int64_t>(rows_q) * Dv, 0.0f);
  if constexpr (kLanes) {
#if defined(__AVX512F__)
    constexpr int C = kHeadDim / 16;
    for_each_slot(a.v_cache, [&](const char* slot, int64_t i) {
      for (int h = 0; h < h1 - h0; ++h) {
        __m512 v[C];
        for (int c = 0; c < C; ++c) v[c] = row16<kDtype>(slot + h * head_bytes, c);
        for (int g = 0; g < group; ++g) {
          const int j = h * group + g;
          const __m512 w = _mm512_set1_ps(scores[j * n + i]);
          float* aj = acc + j * Dv;
          for (int c = 0; c < C; ++c)
            _mm512_storeu_ps(aj + 16 * c, _mm512_fmadd_ps(w, v[c], _mm512_loadu_ps(aj + 16 * c)));
        }
      }
    });
#endif
  } else {
  for_each_slot(a.v_cache, [&](const char* slot, int64_t i) {
    for (int h = 0; h < h1 - h0; ++h) {
      const float* v = row_f32<kDtype>(slot + h * head_bytes, a.lut, a.v_scale, Dv, buf);
      for (int g = 0; g < group; ++g) {
        const int j = h * group + g;
        const float w = scores[j * n + i];
        float* aj = acc + j * Dv;
#pragma omp simd
        for (int d = 0; d < Dv; ++d) aj[d] = std::fma(w, v[d], aj[d]);
      }
    }
  });
  }
  std::copy(acc, acc + static_cast<int64_t>(rows_q) * Dv, o);
  return kOk;
}

// Tasks: one per request with all its KV heads (contiguous reads) when there are enough requests to keep
// every thread busy, else one per (request, KV head). Orphaned: run by every thread of an enclosing
// parallel region (or by one thread outside any); the first error code lands in `status`.
template <int kDtype, int kHeadDim>
void decode_tasks(const DecodeArgs& a, int num_threads, int& status) {
  const bool whole_rows = a.num_requests >= 2 * num_threads || a.num_kv_heads == 1;
  const int heads_per_task = whole_rows ? a.num_kv_heads : 1;
  const int per_request = a.num_kv_heads / heads_per_task;
  const int tasks = a.num_requests * per_request;
  std::vector<float> scores, buf(a.head_dim), acc(static_cast<size_t>(a.num_q_heads) * a.head_dim);
#pragma omp for schedule(dynamic, 1)
  for (int task = 0; task < tasks; ++task) {
    const int b = task / per_request, h0 = (task % per_request) * heads_per_task;
    const int code = decode_heads<kDtype, kHeadDim>(a, b, h0, h0 + heads_per_task, scores, buf.data(), acc.data());
    if (code != kOk) {
#pragma omp atomic write
      status = code;
    }
  }
}

template <int kDtype, int kHeadDim>
int decode_all(const DecodeArgs& a, int num_threads) {
  int status = kOk;
#pragma omp parallel num_threads(num_threads)
  decode_tasks<kDtype, kHeadDim>(a, num_threads, status);
  return status;
}

template <int kDtype>
int decode_dispatch_dim(const DecodeArgs& a, int num_threads) {
  if (a.v_head_dim != a.head_dim) return decode_all<kDtype, 0>(a, num_threads);  // a latent cache: V narrower
  switch (a.head_dim) {
    case 64: return decode_all<kDtype, 64>(a, num_threads);
    case 128: return decode_all<kDtype, 128>(a, num_threads);
    case 256: return decode_all<kDtype, 256>(a, num_threads);
    default: return decode_all<kDtype, 0>(a, num_threads);
  }
}

// One fp32 RMSNorm row (Llama form: w * (x * 1/sqrt(mean(x^2) + eps))).
inline void rms_row_f32(const float* x, const float* w, float* o, int64_t width, float eps) {
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < width; ++i) total += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(total / static_cast<float>(width) + eps);
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) o[i] = w[i] * (x[i] * inv);
}

// One fp32 head of neox RoPE: x * cos + rotate_half(x) * sin, each product and the sum rounded apart.
inline void rope_row_f32(const float* x, const float* c, const float* s, float* o, int64_t head_dim) {
  const int64_t half = head_dim / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i] * c[i], b = -x[i + half] * s[i];
    o[i] = a + b;
  }
#pragma omp simd
  for (int64_t i = half; i < head_dim; ++i) {
    const float a = x[i] * c[i], b = x[i - half] * s[i];
    o[i] = a + b;
  }
}

// silu(x) in a form loops vectorize: with e = exp(-|x|) (never overflows), x / (1 + e) for x >= 0 and
// x * e / (1 + e) below (torch's x / (1 + exp(-x)) within a few ulp).
inline float silu_f32(float x) {
  const float e = exp_nonpositive(-std::fabs(x));
  return (x >= 0.0f ? x : x * e) / (1.0f + e);
}

// One fp32 row of silu(gate) * up, vectorized.
inline void silu_mul_row_f32(const float* g, const float* u, float* o, int64_t width) {
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) o[i] = silu_f32(g[i]) * u[i];
}

}  // namespace
