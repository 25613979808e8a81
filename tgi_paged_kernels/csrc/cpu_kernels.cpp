// CPU kernels of tgi_paged_kernels, built at first use by cpu_native.py (g++ -O3 -march=native -fopenmp
// -ffp-contract=off: a product and a sum round as torch's separate ops do, so RoPE and the norms can match
// transformers bit for bit; the attention output loop asks for its fused multiply-adds explicitly) and called
// through ctypes. Plain C ABI, raw pointers and element strides; no torch headers, so the
// build takes about a second. Every function has a torch reference in tgi_paged_kernels (named in its
// comment) and a test comparing the two. Math is fp32 whatever the storage dtype.
//
// Storage dtype codes (`dtype` arguments): 0 float32, 1 bfloat16 (stored as uint16), 2 one byte per
// value decoded through a 256-entry float table (`lut`, the fp8 formats).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
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
};

constexpr int kOk = 0, kBadDtype = 1, kTableTooNarrow = 2, kBlockOutOfRange = 3;

// One request's KV heads [h0, h1) and the query heads sharing them. Rows are visited in pool order (block,
// slot, head), so a request's whole row of heads is read contiguously when one task holds every head.
// kHeadDim 0: runtime head_dim. Returns kOk, or an error code before reading outside the table or the pool.
template <int kDtype, int kHeadDim>
int decode_heads(const DecodeArgs& a, int b, int h0, int h1, std::vector<float>& scores, float* buf, float* acc) {
  constexpr int64_t bytes = kDtype == 0 ? 4 : (kDtype == 1 ? 2 : 1);
  const int D = kHeadDim > 0 ? kHeadDim : a.head_dim;
  const int group = a.num_q_heads / a.num_kv_heads;
  const int rows_q = (h1 - h0) * group;  // query heads of this task; query head j = h0 * group + j
  const int bs = a.block_size;
  const int64_t len = read_index(a.seq_lens, a.sl_int64, b);
  const int64_t start = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
  const int64_t n = len - start;
  const float* q = a.query + b * a.q_sb + static_cast<int64_t>(h0) * group * a.q_sh;
  float* o = a.out + (static_cast<int64_t>(b) * a.num_q_heads + static_cast<int64_t>(h0) * group) * D;
  if (n <= 0) {
    std::fill(o, o + static_cast<int64_t>(rows_q) * D, 0.0f);
    return kOk;
  }
  if (len > a.bt_width * bs) return kTableTooNarrow;
  const int64_t first_col = start / bs, end_col = (len + bs - 1) / bs;
  for (int64_t col = first_col; col < end_col; ++col) {
    const int64_t blk = read_index(a.block_tables, a.bt_int64, b * a.bt_stride + col);
    if (blk < 0 || blk >= a.num_blocks) return kBlockOutOfRange;
  }
  scores.resize(static_cast<size_t>(n) * rows_q);
  const int64_t slot_bytes = a.c_sslot * bytes, head_bytes = a.c_shead * bytes, row_bytes = D * bytes;
  const int64_t span_bytes = (h1 - h0 - 1) * head_bytes + row_bytes;  // one slot's heads h0..h1-1
  auto block_base = [&](const char* cache, int64_t col) {
    const int64_t blk = read_index(a.block_tables, a.bt_int64, b * a.bt_stride + col);
    return cache + (blk * a.c_sblock + static_cast<int64_t>(h0) * a.c_shead) * bytes;
  };
  // Visits positions [start, len) block by block: fn(row of head h0 at that position, i = position - start).
  auto for_each_slot = [&](const char* cache, auto&& fn) {
    const char* base = block_base(cache, first_col);
    for (int64_t col = first_col; col < end_col; ++col) {
      const char* next = col + 1 < end_col ? block_base(cache, col + 1) : nullptr;
      if (next) prefetch_rows(next, bs, slot_bytes, span_bytes);
      const int64_t s0 = std::max<int64_t>(start - col * bs, 0), s1 = std::min<int64_t>(len - col * bs, bs);
      for (int64_t s = s0; s < s1; ++s) fn(base + s * slot_bytes, col * bs + s - start);
      base = next;
    }
  };
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
  // Softmax per query head; a sink joins the denominator as a score without a value.
  for (int j = 0; j < rows_q; ++j) {
    float* sj = scores.data() + j * n;
    const float sink = a.sinks ? a.sinks[h0 * group + j] : -INFINITY;
    float peak = sink;
#pragma omp simd reduction(max : peak)
    for (int64_t i = 0; i < n; ++i) peak = std::max(peak, sj[i]);
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
  std::fill(acc, acc + static_cast<int64_t>(rows_q) * D, 0.0f);
  for_each_slot(a.v_cache, [&](const char* slot, int64_t i) {
    for (int h = 0; h < h1 - h0; ++h) {
      const float* v = row_f32<kDtype>(slot + h * head_bytes, a.lut, a.v_scale, D, buf);
      for (int g = 0; g < group; ++g) {
        const int j = h * group + g;
        const float w = scores[j * n + i];
        float* aj = acc + j * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) aj[d] = std::fma(w, v[d], aj[d]);
      }
    }
  });
  std::copy(acc, acc + static_cast<int64_t>(rows_q) * D, o);
  return kOk;
}

// Tasks: one per request with all its KV heads (contiguous reads) when there are enough requests to keep
// every thread busy, else one per (request, KV head).
template <int kDtype, int kHeadDim>
int decode_all(const DecodeArgs& a, int num_threads) {
  const bool whole_rows = a.num_requests >= 2 * num_threads || a.num_kv_heads == 1;
  const int heads_per_task = whole_rows ? a.num_kv_heads : 1;
  const int per_request = a.num_kv_heads / heads_per_task;
  const int tasks = a.num_requests * per_request;
  int status = kOk;
#pragma omp parallel num_threads(num_threads)
  {
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
  return status;
}

template <int kDtype>
int decode_dispatch_dim(const DecodeArgs& a, int num_threads) {
  switch (a.head_dim) {
    case 64: return decode_all<kDtype, 64>(a, num_threads);
    case 128: return decode_all<kDtype, 128>(a, num_threads);
    case 256: return decode_all<kDtype, 256>(a, num_threads);
    default: return decode_all<kDtype, 0>(a, num_threads);
  }
}

}  // namespace

extern "C" {

// Decode attention over the paged pool, one query token per request (torch reference:
// cpu_decode.decode_attention_math). query fp32 [B, Hq, D] with strides (q_sb, q_sh), head_dim
// contiguous; caches [num_blocks, block_size, Hkv, D] with element strides (c_sblock, c_sslot, c_shead)
// shared by K and V, storage dtype `cache_dtype` (codes above); block_tables [B, *] (row stride
// bt_stride, int32 or int64); seq_lens [B] (int32 or int64); out fp32 [B, Hq, D] contiguous.
// window <= 0: full attention; softcap <= 0: none; sinks fp32 [Hq] or null. Work is split across
// `num_threads` OpenMP threads by request, or by (request, KV head) when requests are few (decode_all).
// Returns 0; 1 for a bad dtype code, 2 when
// a seq_len needs more blocks than the table's width, 3 for a block id outside [0, num_blocks) (nothing
// outside the table or the pool is read; the output is then undefined).
int tgi_paged_decode_attention(
    const float* query, int64_t q_sb, int64_t q_sh,
    const void* k_cache, const void* v_cache, int cache_dtype, const float* lut,
    int64_t num_blocks, int64_t c_sblock, int64_t c_sslot, int64_t c_shead,
    const void* block_tables, int bt_int64, int64_t bt_stride, int64_t bt_width,
    const void* seq_lens, int sl_int64,
    float* out, int num_requests, int num_q_heads, int num_kv_heads, int head_dim, int block_size,
    float scale, float softcap, int window, const float* sinks, float k_scale, float v_scale, int num_threads) {
  const DecodeArgs a{query, q_sb, q_sh, static_cast<const char*>(k_cache), static_cast<const char*>(v_cache), lut,
                     c_sblock, c_sslot, c_shead, num_blocks, block_tables, bt_int64, bt_stride, bt_width,
                     seq_lens, sl_int64, out,
                     num_requests, num_q_heads, num_kv_heads, head_dim, block_size, scale, softcap, window, sinks,
                     k_scale, v_scale};
  switch (cache_dtype) {
    case 0: return decode_dispatch_dim<0>(a, num_threads);
    case 1: return decode_dispatch_dim<1>(a, num_threads);
    case 2: return decode_dispatch_dim<2>(a, num_threads);
    default: return kBadDtype;
  }
}

// RMSNorm of `rows` rows of `width` values (torch reference: torch.rms_norm, the Llama form transformers
// writes as weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)): x with row stride x_stride, out contiguous,
// weight [width], all in storage dtype `dtype` (0 fp32, 1 bf16; bf16 rounds where torch does: the
// normalised row, then the product with the weight). Rows are split across threads when there are many.
int tgi_paged_rms_norm(const void* x, int64_t x_stride, void* out, const void* weight, int64_t rows, int64_t width,
                       float eps, int dtype, int num_threads) {
  if (dtype != 0 && dtype != 1) return kBadDtype;
  const int threads = rows * width >= (1 << 16) ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    if (dtype == 0) {
      const float* xr = static_cast<const float*>(x) + r * x_stride;
      const float* w = static_cast<const float*>(weight);
      float* o = static_cast<float*>(out) + r * width;
      float total = 0.0f;
#pragma omp simd reduction(+ : total)
      for (int64_t i = 0; i < width; ++i) total += xr[i] * xr[i];
      const float inv = 1.0f / std::sqrt(total / static_cast<float>(width) + eps);
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) o[i] = w[i] * (xr[i] * inv);
    } else {
      const uint16_t* xr = static_cast<const uint16_t*>(x) + r * x_stride;
      const uint16_t* w = static_cast<const uint16_t*>(weight);
      uint16_t* o = static_cast<uint16_t*>(out) + r * width;
      float total = 0.0f;
#pragma omp simd reduction(+ : total)
      for (int64_t i = 0; i < width; ++i) {
        const float v = bf16_to_float(xr[i]);
        total += v * v;
      }
      const float inv = 1.0f / std::sqrt(total / static_cast<float>(width) + eps);
      for (int64_t i = 0; i < width; ++i) {
        const float normed = round_bf16(bf16_to_float(xr[i]) * inv);
        o[i] = float_to_bf16(bf16_to_float(w[i]) * normed);
      }
    }
  }
  return kOk;
}

// K and V of `tokens` new tokens into their pool slots (torch reference: torch_impl.store_kv_torch with a
// pool of the tokens' dtype): key/value [T, Hkv, D] with element strides (token, head) each, head_dim
// contiguous; pools [num_slots, Hkv, D] contiguous per slot with K and V of one layout; slot_mapping
// int64 [T], a negative slot is skipped. `bytes` per element (the copy is bytewise). Returns 0, or 3 for
// a slot outside [0, num_slots) (nothing written for it).
int tgi_paged_store_kv(const void* key, int64_t k_st, int64_t k_sh, const void* value, int64_t v_st, int64_t v_sh,
                       void* k_cache, void* v_cache,
                       int64_t num_slots, const int64_t* slot_mapping, int64_t tokens, int64_t heads,
                       int64_t head_dim, int64_t bytes) {
  int status = kOk;
  const int64_t row = head_dim * bytes;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;
    if (slot >= num_slots) {
      status = kBlockOutOfRange;
      continue;
    }
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t dst = (slot * heads + h) * row;
      std::memcpy(static_cast<char*>(k_cache) + dst, static_cast<const char*>(key) + (t * k_st + h * k_sh) * bytes, row);
      std::memcpy(static_cast<char*>(v_cache) + dst, static_cast<const char*>(value) + (t * v_st + h * v_sh) * bytes,
                  row);
    }
  }
  return status;
}

// Neox-style rotary embedding (torch reference: transformers' apply_rotary_pos_emb, x * cos +
// rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1)): x [T, H, D] with element strides (token,
// head), head_dim contiguous; cos/sin [T, D] contiguous; out [T, H, D] contiguous. Storage dtype 0 fp32
// or 1 bf16 (bf16 rounds after each product and after the sum, as torch's bf16 ops do).
int tgi_paged_rope_neox(const void* x, int64_t x_st, int64_t x_sh, const void* cos, const void* sin, void* out,
                        int64_t tokens, int64_t heads, int64_t head_dim, int dtype) {
  if (dtype != 0 && dtype != 1) return kBadDtype;
  const int64_t half = head_dim / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t src = t * x_st + h * x_sh, dst = (t * heads + h) * head_dim, cs = t * head_dim;
      if (dtype == 0) {
        const float* xr = static_cast<const float*>(x) + src;
        const float* c = static_cast<const float*>(cos) + cs;
        const float* s = static_cast<const float*>(sin) + cs;
        float* o = static_cast<float*>(out) + dst;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = xr[i] * c[i], b = -xr[i + half] * s[i];
          o[i] = a + b;
        }
#pragma omp simd
        for (int64_t i = half; i < head_dim; ++i) {
          const float a = xr[i] * c[i], b = xr[i - half] * s[i];
          o[i] = a + b;
        }
      } else {
        const uint16_t* xr = static_cast<const uint16_t*>(x) + src;
        const uint16_t* c = static_cast<const uint16_t*>(cos) + cs;
        const uint16_t* s = static_cast<const uint16_t*>(sin) + cs;
        uint16_t* o = static_cast<uint16_t*>(out) + dst;
        for (int64_t i = 0; i < head_dim; ++i) {
          const float rotated = i < half ? -bf16_to_float(xr[i + half]) : bf16_to_float(xr[i - half]);
          const float a = round_bf16(bf16_to_float(xr[i]) * bf16_to_float(c[i]));
          const float b = round_bf16(rotated * bf16_to_float(s[i]));
          o[i] = float_to_bf16(a + b);
        }
      }
    }
  }
  return kOk;
}

// silu(gate) * up for gate_up [T, 2 * I] (gate first), out [T, I], both row-contiguous (torch reference:
// F.silu(gate) * up). Storage dtype 0 fp32 or 1 bf16 (bf16 rounds silu's result, then the product).
int tgi_paged_silu_and_mul(const void* gate_up, int64_t row_stride, void* out, int64_t tokens, int64_t width,
                           int dtype, int num_threads) {
  if (dtype != 0 && dtype != 1) return kBadDtype;
  const int threads = tokens * width >= (1 << 16) ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    if (dtype == 0) {
      const float* g = static_cast<const float*>(gate_up) + t * row_stride;
      const float* u = g + width;
      float* o = static_cast<float*>(out) + t * width;
      for (int64_t i = 0; i < width; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    } else {
      const uint16_t* g = static_cast<const uint16_t*>(gate_up) + t * row_stride;
      const uint16_t* u = g + width;
      uint16_t* o = static_cast<uint16_t*>(out) + t * width;
      for (int64_t i = 0; i < width; ++i) {
        const float x = bf16_to_float(g[i]);
        const float silu = round_bf16(x / (1.0f + std::exp(-x)));
        o[i] = float_to_bf16(silu * bf16_to_float(u[i]));
      }
    }
  }
  return kOk;
}

// Greedy choice over fp32 logits rows [B, V] (row stride `stride`): ids[b] = argmax (the first maximum,
// as torch.argmax), logprobs[b] = its log_softmax value, max - max - log(sum(exp(x - max))) (torch
// reference: log_softmax(x).gather(argmax)); NaN anywhere in a row gives the id of the first NaN and a NaN
// logprob, as torch's argmax and log_softmax do; a row of only -inf gives -inf where torch gives NaN.
// Rows are split across threads.
int tgi_paged_greedy(const float* logits, int64_t stride, int64_t rows, int64_t vocab, int64_t* ids, float* logprobs,
                     int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t b = 0; b < rows; ++b) {
    const float* x = logits + b * stride;
    int64_t best = 0;
    float peak = x[0];
    for (int64_t i = 1; i < vocab; ++i) {
      if (std::isnan(peak)) break;
      if (x[i] > peak || std::isnan(x[i])) {
        peak = x[i];
        best = i;
      }
    }
    // NaN (torch: NaN), a +inf maximum (torch: NaN) or every entry -inf (torch: NaN, here -inf): the caller
    // maps all of them to the same finite value.
    if (std::isnan(peak) || std::isinf(peak)) {
      ids[b] = best;
      logprobs[b] = std::isnan(peak) ? peak : (peak > 0 ? NAN : -INFINITY);
      continue;
    }
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < vocab; ++i) total += exp_nonpositive(x[i] - peak);
    ids[b] = best;
    logprobs[b] = -std::log(total);
  }
  return kOk;
}

}  // extern "C"
