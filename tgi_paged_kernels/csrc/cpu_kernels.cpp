// CPU kernels of tgi_paged_kernels, built at first use by cpu_native.py (g++ -O3 -march=native -fopenmp
// -ffp-contract=off: a product and a sum round as torch's separate ops do, so RoPE and the norms can match
// transformers bit for bit; the attention output loop asks for its fused multiply-adds explicitly) and called
// through ctypes. Plain C ABI, raw pointers and element strides; no torch headers, so the
// build takes about a second. Every function has a torch reference in tgi_paged_kernels (named in its
// comment) and a test comparing the two. Math is fp32 whatever the storage dtype.
//
// Storage dtype codes (`dtype` arguments): 0 float32, 1 bfloat16 (stored as uint16), 2 one byte per
// value decoded through a 256-entry float table (`lut`, the fp8 formats).

#include "cpu_common.h"

extern "C" {

// Decode attention over the paged pool, one query token per request (torch reference:
// cpu_decode.decode_attention_math). query fp32 [B, Hq, D] with strides (q_sb, q_sh), head_dim
// contiguous; caches [num_blocks, block_size, Hkv, D] with element strides (c_sblock, c_sslot, c_shead)
// shared by K and V, storage dtype `cache_dtype` (codes above), V's rows v_head_dim <= D wide (a latent
// cache: V is K's first v_head_dim columns); block_tables [B, *] (row stride
// bt_stride, int32 or int64); seq_lens [B] (int32 or int64); out fp32 [B, Hq, v_head_dim] contiguous.
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
    float scale, float softcap, int window, const float* sinks, float k_scale, float v_scale, int num_threads,
    int v_head_dim) {
  if (v_head_dim <= 0 || v_head_dim > head_dim) return kBadDtype;
  const DecodeArgs a{query, q_sb, q_sh, static_cast<const char*>(k_cache), static_cast<const char*>(v_cache), lut,
                     c_sblock, c_sslot, c_shead, num_blocks, block_tables, bt_int64, bt_stride, bt_width,
                     seq_lens, sl_int64, out,
                     num_requests, num_q_heads, num_kv_heads, head_dim, block_size, scale, softcap, window, sinks,
                     k_scale, v_scale, v_head_dim};
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
      rms_row_f32(static_cast<const float*>(x) + r * x_stride, static_cast<const float*>(weight),
                  static_cast<float*>(out) + r * width, width, eps);
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
  // A prefill's tokens split across the runtime's threads (torch's count); a decode step's stay on one.
#pragma omp parallel for schedule(static) if (tokens * heads * head_dim >= (1 << 16))
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t src = t * x_st + h * x_sh, dst = (t * heads + h) * head_dim, cs = t * head_dim;
      if (dtype == 0) {
        rope_row_f32(static_cast<const float*>(x) + src, static_cast<const float*>(cos) + cs,
                     static_cast<const float*>(sin) + cs, static_cast<float*>(out) + dst, head_dim);
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
      silu_mul_row_f32(g, g + width, static_cast<float*>(out) + t * width, width);
    } else {
      const uint16_t* g = static_cast<const uint16_t*>(gate_up) + t * row_stride;
      const uint16_t* u = g + width;
      uint16_t* o = static_cast<uint16_t*>(out) + t * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i)  // rounded where torch's bf16 ops round
        o[i] = float_to_bf16(round_bf16(silu_f32(bf16_to_float(g[i]))) * bf16_to_float(u[i]));
    }
  }
  return kOk;
}

}  // extern "C"
