// A Llama-form decoder layer's decode step as one call (fp32), on weights packed once for the GEMM of
// cpu_gemm.h. Built into the same library as cpu_kernels.cpp (cpu_native.py). Torch references:
// tgi_paged_kernels.cpu_layer (gemm_packed_ref, llama_decode_layer_ref), compared in
// tests/kernels/test_cpu_layer.py.

#include "cpu_gemm.h"

namespace {

constexpr int kSlotOutOfRange = 5;  // a slot_mapping entry past the pool

struct LayerArgs {
  float* hidden;  // [T, H] in/out: the residual stream
  int64_t tokens, hidden_size, intermediate;
  const float *ln1, *ln2;
  float eps1, eps2;
  const float *w_qkv, *b_qkv, *w_o, *w_gate_up, *w_down;  // packed; b_qkv may be null
  const float *cos, *sin;  // [T, D]
  const int64_t* slot_mapping;
  float* scratch;
};

template <int kHeadDim>
int layer_impl(const LayerArgs& L, DecodeArgs d, int num_threads) {
  const int64_t T = L.tokens, H = L.hidden_size, I = L.intermediate;
  const int hq = d.num_q_heads, hkv = d.num_kv_heads, D = d.head_dim;
  const int64_t n_qkv = static_cast<int64_t>(hq + 2 * hkv) * D, n_q = static_cast<int64_t>(hq) * D;
  const int64_t num_slots = d.num_blocks * d.block_size;
  float* x = L.scratch;              // [T, H] normed
  float* qkv = x + T * H;            // [T, n_qkv]
  float* qk = qkv + T * n_qkv;       // [T, hq + hkv, D] after RoPE
  float* attn = qk + T * (n_q + static_cast<int64_t>(hkv) * D);  // [T, hq * D]
  float* gate_up = attn + T * n_q;   // [T, 2I]
  float* act = gate_up + T * 2 * I;  // [T, I]
  d.query = qk;
  d.q_sb = static_cast<int64_t>(hq + hkv) * D;
  d.q_sh = D;
  d.out = attn;
  int status = kOk;
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) rms_row_f32(L.hidden + t * H, L.ln1, x + t * H, H, L.eps1);
    gemm_packed(x, H, T, H, L.w_qkv, n_qkv, L.b_qkv, nullptr, 0, qkv, n_qkv);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const float* row = qkv + t * n_qkv;
      float* rotated = qk + t * d.q_sb;
      for (int h = 0; h < hq + hkv; ++h) rope_row_f32(row + h * D, L.cos + t * D, L.sin + t * D, rotated + h * D, D);
      const int64_t slot = L.slot_mapping[t];
      if (slot < 0) continue;
      if (slot >= num_slots) {
#pragma omp atomic write
        status = kSlotOutOfRange;
        continue;
      }
      const int64_t base = (slot / d.block_size) * d.c_sblock + (slot % d.block_size) * d.c_sslot;
      for (int h = 0; h < hkv; ++h) {
        std::memcpy(const_cast<char*>(d.k_cache) + (base + h * d.c_shead) * 4, rotated + (hq + h) * D, D * 4);
        std::memcpy(const_cast<char*>(d.v_cache) + (base + h * d.c_shead) * 4, row + n_q + (hkv + h) * D, D * 4);
      }
    }
    decode_tasks<0, kHeadDim>(d, num_threads, status);
    gemm_packed(attn, n_q, T, n_q, L.w_o, H, nullptr, L.hidden, H, L.hidden, H);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) rms_row_f32(L.hidden + t * H, L.ln2, x + t * H, H, L.eps2);
    gemm_packed(x, H, T, H, L.w_gate_up, 2 * I, nullptr, nullptr, 0, gate_up, 2 * I);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) silu_mul_row_f32(gate_up + t * 2 * I, gate_up + t * 2 * I + I, act + t * I, I);
    gemm_packed(act, I, T, I, L.w_down, H, nullptr, L.hidden, H, L.hidden, H);
  }
  return status;
}

}  // namespace

extern "C" {

// out[M, N] = a[M, K] @ W^T (+ bias) (+ add), W packed as above (torch reference: cpu_layer_ref.gemm_packed_ref).
// a, add and out row-major with the given row strides; bias [N] or null; add may be null or alias out.
int tgi_paged_gemm_packed(const float* a, int64_t lda, int64_t M, int64_t K, const float* packed, int64_t N,
                          const float* bias, const float* add, int64_t ldadd, float* out, int64_t ldo, int num_threads) {
#pragma omp parallel num_threads(num_threads)
  gemm_packed(a, lda, M, K, packed, N, bias, add, ldadd, out, ldo);
  return kOk;
}

// One decode step of a Llama-form decoder layer over T requests (one token each), fp32 throughout (torch
// reference: cpu_layer_ref.llama_decode_layer_ref):
//   h += o_proj(attention(rope(qkv_proj(rms_norm(h, ln1))))); h += down(silu(gate) * up)(rms_norm(h, ln2))
// hidden [T, H] contiguous, updated in place; w_qkv packed [(Hq + 2 Hkv) D, H] (q, k, v heads in order) with
// optional bias; w_o [H, Hq D]; w_gate_up [2I, H] (gate rows first); w_down [H, I]; cos/sin [T, D]; the
// new K (after RoPE) and V are written to their slots of fp32 pools [num_blocks, block_size, Hkv, D]
// (element strides c_sblock, c_sslot, c_shead; negative slots skipped) before request b attends over its
// seq_lens[b] positions (window > 0: the last `window`). scratch: T * (H + (2 Hq + 3 Hkv) D + Hq D + 3I)
// floats. Returns 0; 2 for a table too narrow for a seq_len, 3 for a block id outside the pool, 5 for a slot
// outside the pool.
int tgi_paged_llama_decode_layer(
    float* hidden, int64_t tokens, int64_t hidden_size, int64_t intermediate,
    const float* ln1, float eps1, const float* ln2, float eps2,
    const float* w_qkv, const float* b_qkv, const float* w_o, const float* w_gate_up, const float* w_down,
    const float* cos, const float* sin,
    void* k_cache, void* v_cache, int64_t num_blocks, int64_t c_sblock, int64_t c_sslot, int64_t c_shead,
    const int64_t* slot_mapping, const void* block_tables, int bt_int64, int64_t bt_stride, int64_t bt_width,
    const void* seq_lens, int sl_int64,
    int num_q_heads, int num_kv_heads, int head_dim, int block_size, float scale, int window,
    float* scratch, int num_threads) {
  const LayerArgs L{hidden, tokens, hidden_size, intermediate, ln1, ln2, eps1, eps2, w_qkv, b_qkv, w_o,
                    w_gate_up, w_down, cos, sin, slot_mapping, scratch};
  const DecodeArgs d{nullptr, 0, 0, static_cast<const char*>(k_cache), static_cast<const char*>(v_cache), nullptr,
                     c_sblock, c_sslot, c_shead, num_blocks, block_tables, bt_int64, bt_stride, bt_width,
                     seq_lens, sl_int64, nullptr, static_cast<int>(tokens), num_q_heads, num_kv_heads, head_dim,
                     block_size, scale, 0.0f, window, nullptr, 1.0f, 1.0f};
  switch (head_dim) {
    case 64: return layer_impl<64>(L, d, num_threads);
    case 128: return layer_impl<128>(L, d, num_threads);
    default: return layer_impl<0>(L, d, num_threads);
  }
}

}  // extern "C"
