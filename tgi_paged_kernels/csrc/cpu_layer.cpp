// A decoder layer's decode step as one call (fp32 arithmetic), for any layer form the LayerSpec describes (norm
// placement, q/k norms, activation, biases, attention scale, soft-cap, window, residual scale), on weights
// packed once for the GEMM of cpu_gemm.h (fp32) or cpu_gemm_bf16.h (bf16); hidden state and pools fp32 or bf16.
// Built into the same library as cpu_kernels.cpp (cpu_native.py).
// Torch references: tgi_paged_kernels.cpu_layer_ref (gemm_packed_ref, decode_layer_ref), compared in
// tests/kernels/test_cpu_layer.py.

#include "cpu_gemm.h"
#include "cpu_gemm_bf16.h"
#include "cpu_gemm_quant.h"
#include "cpu_layer_rows.h"
#include "cpu_lora.h"
#include "cpu_moe.h"

namespace {

constexpr int kSlotOutOfRange = 5;  // a slot_mapping entry past the pool
constexpr int kBadSpec = 6;         // an activation or q/k norm code this library does not know

// What one decoder layer computes, as data (cpu_layer.LayerForm, packed by cpu_layer.LayerWeights; the
// ctypes mirror is cpu_layer._Spec, field for field). Norm weights are RMSNorm weights with the form's
// offset folded in (Gemma's 1 + w is stored as 1 + w); a null norm is a norm the layer does not have.
struct LayerSpec {
  int64_t hidden_size, intermediate;
  int32_t num_q_heads, num_kv_heads, head_dim, window;
  int32_t activation;  // 0 SiLU, 1 GeLU (tanh approximation), 2 GeLU (erf, exact), 3 ReLU
  int32_t qk_norm;     // 0 none, 1 per head (weights [D]), 2 over all query / all key heads ([Hq D], [Hkv D])
  int32_t rope;        // 0 neox (halves), 1 interleaved (pairs 2i, 2i + 1: Cohere), 2 none (Cohere2's full layers)
  int32_t parallel;    // 1: h += attn(n_ai(h)) + mlp(n_mi(h)), n_mi the attention's n_ai when absent (Cohere)
  int32_t layer_norm;  // 1: the four layer norms are LayerNorms ((x - mean) / std * w (+ b)), not RMSNorms
  int32_t rotary_dim;  // RoPE on the first rotary_dim values of each head (cos/sin [T, rotary_dim]), the rest kept
  int32_t gated;       // 1: act(gate) * up from w_gate_up [2I, H]; 0: act(up) from w_gate_up [I, H] (Phi's fc1)
  int32_t post_add;    // 1: the attn_out / mlp_out norms apply to h after the residual add (OPT's post-LN)
  int32_t experts, top_k, norm_top_k;  // experts > 0: an MoE MLP (cpu_moe.h), gated, w_gate_up / w_down per expert
  int32_t shared_intermediate;  // > 0: plus a shared expert, sigmoid(w_shared_gate . x) * its gated MLP (Qwen2-MoE)
  float scale, softcap, residual_scale;
  int32_t weight_dtype;  // the packed projections: 0 fp32 (cpu_gemm.h), 1 bf16 (cpu_gemm_bf16.h), 2 int8 codes,
                         // 3 fp8 e4m3 codes (cpu_gemm_quant.h: the four projections only, no MoE); norms stay fp32
  float eps_attn_in, eps_attn_out, eps_mlp_in, eps_mlp_out, eps_q, eps_k;
  const float *attn_in, *attn_out, *mlp_in, *mlp_out;  // before / after attention, before / after the MLP
  const float *q_norm, *k_norm;
  const void* w_qkv;                           // packed in weight_dtype, as w_o, w_gate_up, w_down, w_router, ...
  const float* b_qkv;                          // may be null
  const void *w_o, *w_gate_up, *w_down;
  const float *attn_in_b, *attn_out_b, *mlp_in_b, *mlp_out_b;  // LayerNorm biases (null: none)
  const float *b_o, *b_gate_up, *b_down;                       // projection biases (null: none)
  const void* w_router;                                        // packed [experts, H] (MoE only)
  const void *w_shared_gate_up, *w_shared_down, *w_shared_gate;  // packed [2Is, H], [H, Is], [1, H]
  const float* w_zeros[4];   // int8 / fp8: per packed column of w_qkv, w_o, w_gate_up, w_down (kQkv .. kDown)
  const float* w_scales[4];  // the same columns' scales
};

enum Projection { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3 };

// gemm_packed of one of the layer's four projections (w its packed weight) in the spec's weight dtype: int8 codes
// with their columns' zeros and scales (cpu_gemm_quant.h), else fp32 or bf16 (gemm_weights, cpu_gemm_bf16.h).
inline void gemm_proj(const LayerSpec& S, int p, const float* a, int64_t lda, int64_t M, int64_t K, const void* w,
                      int64_t N, const float* bias, const float* add, int64_t ldadd, float* out, int64_t ldo) {
  if (S.weight_dtype == 2) {
    gemm_packed_i8<false>(a, lda, M, K, static_cast<const uint8_t*>(w), S.w_zeros[p], S.w_scales[p], N, bias, add,
                          ldadd, out, ldo);
  } else if (S.weight_dtype == 3) {
    gemm_packed_i8<true>(a, lda, M, K, static_cast<const uint8_t*>(w), S.w_zeros[p], S.w_scales[p], N, bias, add,
                         ldadd, out, ldo);
  } else {
    gemm_weights(S.weight_dtype, a, lda, M, K, w, N, bias, add, ldadd, out, ldo);
  }
}

struct StepArgs {
  float* hidden;  // [T, H] in/out: the residual stream (fp32; a bf16 step's widened copy of hidden_bf16)
  int64_t tokens;
  const float *cos, *sin;  // [T, R] (a bf16 step's widened copies)
  const int64_t* slot_mapping;
  float* scratch;
  int stage;       // 0: the whole layer; 1, 2, 3: a tensor-parallel rank's parts (tgi_paged_decode_layer_stage)
  float* partial;  // [T, H] stages 1-3: the rank's partial sums of a row-parallel projection, all-reduced between
  const LayerLora* lora;          // null: no adapter rows (cpu_lora.h; stage 0 only)
  const LoraGroups* lora_groups;  // the rows with an adapter, grouped by it
  uint16_t* hidden_bf16;               // a bf16 step: [T, H] in/out, widened at entry, rounded (RNE) at exit
  const uint16_t *cos_bf16, *sin_bf16;  // a bf16 step's tables [T, R] (null without RoPE)
};

// A bf16 step's inputs widened into the fp32 buffers of `A` (work-shared).
inline void widen_inputs(const StepArgs& A, int64_t H, int64_t R) {
#pragma omp for schedule(static)
  for (int64_t t = 0; t < A.tokens; ++t) {
    for (int64_t i = 0; i < H; ++i) A.hidden[t * H + i] = bf16_to_float(A.hidden_bf16[t * H + i]);
    if (!A.cos_bf16) continue;
    for (int64_t i = 0; i < R; ++i) {
      const_cast<float*>(A.cos)[t * R + i] = bf16_to_float(A.cos_bf16[t * R + i]);
      const_cast<float*>(A.sin)[t * R + i] = bf16_to_float(A.sin_bf16[t * R + i]);
    }
  }
}

// hidden[t] += scale * norm(y[t]) (norm: RMSNorm with weight w, skipped when w is null) for T rows of H;
// y is scratch, normed in place. The sum rounds like torch's residual + y * scale. post_add: hidden[t] =
// norm(hidden[t] + y[t]) instead (OPT's post-LN; scale is 1 there).
inline void add_residual(float* hidden, float* y, int64_t T, int64_t H, const float* w, const float* b, float eps,
                         float scale, bool layer_norm, bool post_add) {
#pragma omp for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    float* yt = y + t * H;
    float* ht = hidden + t * H;
    if (post_add) {
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) ht[i] = ht[i] + yt[i];
      if (w) norm_in_place(ht, w, b, H, eps, layer_norm);
      continue;
    }
    if (w) norm_in_place(yt, w, b, H, eps, layer_norm);
    if (scale == 1.0f) {
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) ht[i] = ht[i] + yt[i];
    } else {
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) ht[i] = ht[i] + yt[i] * scale;
    }
  }
}

// y[t] += b1 (+ b2) (a row-parallel projection's replicated biases, added once to the all-reduced sums; null:
// none), then onto hidden as add_residual adds a block's output.
inline void add_reduced(float* hidden, float* y, int64_t T, int64_t H, const float* b1, const float* b2,
                        const float* w, const float* b, float eps, const LayerSpec& S) {
#pragma omp for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; b1 && i < H; ++i) y[t * H + i] = y[t * H + i] + b1[i];
    for (int64_t i = 0; b2 && i < H; ++i) y[t * H + i] = y[t * H + i] + b2[i];
  }
  add_residual(hidden, y, T, H, w, b, eps, S.residual_scale, S.layer_norm, S.post_add);
}

// act[r] = activation of gate_up[r] (gated: act(gate) * up) for `rows` rows of the layer's MLP (work-shared).
inline void activate_rows(const LayerSpec& S, const float* gate_up, float* act, int64_t rows, int64_t I) {
  const int64_t n_gu = S.gated ? 2 * I : I;
#pragma omp for schedule(static)
  for (int64_t t = 0; t < rows; ++t) {
    const float* g = gate_up + t * n_gu;
    if (S.activation == 0) {
      silu_mul_row_f32(g, g + I, act + t * I, I);  // gated only
    } else if (S.activation == 1) {
      S.gated ? gelu_tanh_mul_row_f32<true>(g, g + I, act + t * I, I)
              : gelu_tanh_mul_row_f32<false>(g, nullptr, act + t * I, I);
    } else if (S.activation == 2) {
      S.gated ? gelu_erf_mul_row_f32<true>(g, g + I, act + t * I, I)
              : gelu_erf_mul_row_f32<false>(g, nullptr, act + t * I, I);
    } else {
      S.gated ? relu_mul_row_f32<true>(g, g + I, act + t * I, I) : relu_mul_row_f32<false>(g, nullptr, act + t * I, I);
    }
  }
}

// One value of a pool of storage dtype kKv (0 fp32, 1 bf16: rounded to nearest even).
template <int kKv>
inline void store_row(char* dst, const float* src, int n) {
  if constexpr (kKv == 0) {
    std::memcpy(dst, src, static_cast<size_t>(n) * 4);
  } else {
    uint16_t* d = reinterpret_cast<uint16_t*>(dst);
    for (int i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
  }
}

template <int kKv, int kHeadDim>
int layer_impl(const LayerSpec& S, const StepArgs& A, DecodeArgs d, int num_threads) {
  const int64_t T = A.tokens, H = S.hidden_size, I = S.intermediate;
  const int hq = d.num_q_heads, hkv = d.num_kv_heads, D = d.head_dim;
  const int64_t n_qkv = static_cast<int64_t>(hq + 2 * hkv) * D, n_q = static_cast<int64_t>(hq) * D;
  const int64_t num_slots = d.num_blocks * d.block_size;
  float* x = A.scratch;              // [T, H] normed input of a block, then a block's output before its add
  float* qkv = x + T * H;            // [T, n_qkv]
  float* qk = qkv + T * n_qkv;       // [T, hq + hkv, D] after the q/k norms and RoPE
  float* attn = qk + T * (n_q + static_cast<int64_t>(hkv) * D);  // [T, hq * D]
  float* gate_up = attn + T * n_q;   // [T, 2I]
  float* act = gate_up + T * 2 * I;  // [T, I]
  float* x_mlp = act + T * I;        // [T, H] a parallel block's MLP input (its own norm of h)
  // A block's output goes straight onto the residual stream in the GEMM's epilogue unless it is normed or
  // scaled first (sandwich norms, residual multipliers): then through x and add_residual.
  // A LoRA delta of o or down joins its projection's output before a norm or scale (as the per-op path adds it);
  // a block that goes straight onto h gets its delta there too (the same sum, no pass through x).
  const bool direct_attn = !S.attn_out && S.residual_scale == 1.0f;
  const bool direct_mlp = !S.mlp_out && S.residual_scale == 1.0f;
  d.query = qk;
  d.q_sb = static_cast<int64_t>(hq + hkv) * D;
  d.q_sh = D;
  d.out = attn;
  int status = kOk;
  MoeRouting routing;  // shared: filled by one thread, read by all (MoE forms)
  const int stage = A.stage;
  float* partial = A.partial;
#pragma omp parallel num_threads(num_threads)
  {
    // a bf16 step: widened at entry (a rank's stage 1; the fp32 copy in scratch carries h to stages 2 and 3)
    if (A.hidden_bf16 && stage <= 1) widen_inputs(A, H, S.rotary_dim);
    const float* attn_x = A.hidden;
    if (stage <= 1 && S.attn_in) {
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t)
        norm_row(A.hidden + t * H, S.attn_in, S.attn_in_b, x + t * H, H, S.eps_attn_in, S.layer_norm);
      attn_x = x;
    }
    if (stage <= 1 && S.parallel && S.mlp_in) {  // GPT-NeoX: the MLP's own norm of h, before the attention adds to it
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t)
        norm_row(A.hidden + t * H, S.mlp_in, S.mlp_in_b, x_mlp + t * H, H, S.eps_mlp_in, S.layer_norm);
    }
    if (stage <= 1) gemm_proj(S, kQkv, attn_x, H, T, H, S.w_qkv, n_qkv, S.b_qkv, nullptr, 0, qkv, n_qkv);
    lora_add_rows(A.lora, *A.lora_groups, kQkv, attn_x, H, qkv, n_qkv);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < (stage <= 1 ? T : 0); ++t) {
      float* row = qkv + t * n_qkv;
      float* rotated = qk + t * d.q_sb;
      if (S.qk_norm) {
        qk_norm_heads(row, hq, D, S.qk_norm, S.q_norm, S.eps_q);
        qk_norm_heads(row + n_q, hkv, D, S.qk_norm, S.k_norm, S.eps_k);
      }
      const int R = S.rotary_dim;
      const float* c = S.rope == 2 ? nullptr : A.cos + t * R;  // no tables without RoPE (learned positions)
      const float* s = S.rope == 2 ? nullptr : A.sin + t * R;
      if (S.rope == 0) {
        for (int h = 0; h < hq + hkv; ++h) rope_row_f32(row + h * D, c, s, rotated + h * D, R);
      } else if (S.rope == 1) {
        for (int h = 0; h < hq + hkv; ++h) rope_interleaved_row_f32(row + h * D, c, s, rotated + h * D, R);
      } else {
        std::memcpy(rotated, row, static_cast<size_t>(hq + hkv) * D * 4);
      }
      if (S.rope != 2 && R < D) {  // partial rotary: the rest of each head as it is
        for (int h = 0; h < hq + hkv; ++h) std::memcpy(rotated + h * D + R, row + h * D + R, (D - R) * 4);
      }
      const int64_t slot = A.slot_mapping[t];
      if (slot < 0) continue;
      if (slot >= num_slots) {
#pragma omp atomic write
        status = kSlotOutOfRange;
        continue;
      }
      const int64_t base = (slot / d.block_size) * d.c_sblock + (slot % d.block_size) * d.c_sslot;
      constexpr int64_t bytes = kKv == 0 ? 4 : 2;
      for (int h = 0; h < hkv; ++h) {
        store_row<kKv>(const_cast<char*>(d.k_cache) + (base + h * d.c_shead) * bytes, rotated + (hq + h) * D, D);
        store_row<kKv>(const_cast<char*>(d.v_cache) + (base + h * d.c_shead) * bytes, row + n_q + (hkv + h) * D, D);
      }
    }
    if (stage <= 1) decode_tasks<kKv, kHeadDim>(d, num_threads, status);
    if (stage == 1) {  // the rank's partial sums of o (its bias comes after the all-reduce)
      gemm_proj(S, kO, attn, n_q, T, n_q, S.w_o, H, nullptr, nullptr, 0, partial, H);
    } else if (stage == 2) {
      add_reduced(A.hidden, partial, T, H, S.b_o, nullptr, S.attn_out, S.attn_out_b, S.eps_attn_out, S);
    } else if (stage == 3) {  // a parallel block's partial sums are both blocks' (one all-reduce)
      add_reduced(A.hidden, partial, T, H, S.b_down, S.parallel ? S.b_o : nullptr, S.mlp_out, S.mlp_out_b,
                  S.eps_mlp_out, S);
    } else if (direct_attn) {
      gemm_proj(S, kO, attn, n_q, T, n_q, S.w_o, H, S.b_o, A.hidden, H, A.hidden, H);
      lora_add_rows(A.lora, *A.lora_groups, kO, attn, n_q, A.hidden, H);
    } else {
      gemm_proj(S, kO, attn, n_q, T, n_q, S.w_o, H, S.b_o, nullptr, 0, x, H);
      lora_add_rows(A.lora, *A.lora_groups, kO, attn, n_q, x, H);
      add_residual(A.hidden, x, T, H, S.attn_out, S.attn_out_b, S.eps_attn_out, S.residual_scale, S.layer_norm,
                   S.post_add);
    }
    // stage 1 of a sequential block ends with o's partial sums (the all-reduce comes next); stage 3 is done
    const bool mlp_here = stage == 0 || stage == 2 || (stage == 1 && S.parallel);
    const float* mlp_x = A.hidden;
    if (!mlp_here) {
    } else if (S.parallel) {  // x still holds the normed input: the attention's output went straight onto h
      mlp_x = S.mlp_in ? x_mlp : attn_x;
    } else if (S.mlp_in) {
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t)
        norm_row(A.hidden + t * H, S.mlp_in, S.mlp_in_b, x + t * H, H, S.eps_mlp_in, S.layer_norm);
      mlp_x = x;
    }
    if (!mlp_here) {
    } else if (S.experts > 0) {  // the MoE MLP's sum goes to moe_out, then onto h like a normed block's output
      float* moe_out = x_mlp + T * H;
      moe_mlp(mlp_x, T, H, I, S.experts, S.top_k, S.norm_top_k, S.weight_dtype, S.w_router, S.w_gate_up, S.w_down,
              moe_out + T * H, gate_up, act, moe_out, routing,
              [&S](const float* gu, float* a, int64_t rows) { activate_rows(S, gu, a, rows, S.intermediate); });
      if (S.shared_intermediate > 0) {  // moe_out += sigmoid(x . w_shared_gate) * shared(x), as Qwen2-MoE adds it
        const int64_t Is = S.shared_intermediate;
        float* s_gu = moe_out + T * (S.experts + 3 * H);
        float *s_act = s_gu + T * 2 * Is, *s_out = s_act + T * Is, *s_gate = s_out + T * H;
        gemm_weights(S.weight_dtype, mlp_x, H, T, H, S.w_shared_gate_up, 2 * Is, nullptr, nullptr, 0, s_gu, 2 * Is);
        activate_rows(S, s_gu, s_act, T, Is);
        gemm_weights(S.weight_dtype, s_act, Is, T, Is, S.w_shared_down, H, nullptr, nullptr, 0, s_out, H);
        gemm_weights(S.weight_dtype, mlp_x, H, T, H, S.w_shared_gate, 1, nullptr, nullptr, 0, s_gate, 1);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
          const float g = 1.0f / (1.0f + std::exp(-s_gate[t]));
          for (int64_t i = 0; i < H; ++i) moe_out[t * H + i] = moe_out[t * H + i] + g * s_out[t * H + i];
        }
      }
      if (stage) {  // a rank's share (its slice of every expert's intermediate, the routing replicated)
#pragma omp for schedule(static)
        for (int64_t i = 0; i < T * H; ++i) partial[i] = moe_out[i];
      } else {
        add_residual(A.hidden, moe_out, T, H, S.mlp_out, S.mlp_out_b, S.eps_mlp_out, S.residual_scale,
                     S.layer_norm, S.post_add);
      }
    } else {
      const int64_t n_gu = S.gated ? 2 * I : I;
      gemm_proj(S, kGateUp, mlp_x, H, T, H, S.w_gate_up, n_gu, S.b_gate_up, nullptr, 0, gate_up, n_gu);
      lora_add_rows(A.lora, *A.lora_groups, kGateUp, mlp_x, H, gate_up, n_gu);
      activate_rows(S, gate_up, act, T, I);
      if (stage) {  // the rank's partial sums of down (onto o's in a parallel block)
        gemm_proj(S, kDown, act, I, T, I, S.w_down, H, nullptr, stage == 1 ? partial : nullptr, H, partial, H);
      } else if (direct_mlp) {
        gemm_proj(S, kDown, act, I, T, I, S.w_down, H, S.b_down, A.hidden, H, A.hidden, H);
        lora_add_rows(A.lora, *A.lora_groups, kDown, act, I, A.hidden, H, !A.hidden_bf16);  // the region's end
      } else {
        gemm_proj(S, kDown, act, I, T, I, S.w_down, H, S.b_down, nullptr, 0, x, H);
        lora_add_rows(A.lora, *A.lora_groups, kDown, act, I, x, H);
        add_residual(A.hidden, x, T, H, S.mlp_out, S.mlp_out_b, S.eps_mlp_out, S.residual_scale, S.layer_norm,
                     S.post_add);
      }
    }
    if (A.hidden_bf16 && (stage == 0 || stage == 3)) {  // the step's output rounded to bf16 once, at its end
#pragma omp for schedule(static)
      for (int64_t i = 0; i < T * H; ++i) A.hidden_bf16[i] = float_to_bf16(A.hidden[i]);
    }
  }
  return status;
}

template <int kKv>
int layer_dispatch_dim(const LayerSpec& S, const StepArgs& A, const DecodeArgs& d, int num_threads) {
  switch (S.head_dim) {
    case 64: return layer_impl<kKv, 64>(S, A, d, num_threads);
    case 128: return layer_impl<kKv, 128>(S, A, d, num_threads);
    case 256: return layer_impl<kKv, 256>(S, A, d, num_threads);
    default: return layer_impl<kKv, 0>(S, A, d, num_threads);
  }
}

}  // namespace

extern "C" {

// The decode step of a tensor-parallel rank's layer `spec` (its heads' and MLP columns' slices), in the parts
// between the all-reduces of its row-parallel projections (o, down), which the caller runs on `partial` [T, H]:
//   stage 1: the attention (K/V stored) and o's partial sums (no bias) to partial; a parallel block adds the
//            MLP's partial sums of down to them (one all-reduce for both);
//   stage 2 (sequential blocks): h += rs * n_ao(partial + b_o), then the MLP's partial sums of down to partial;
//   stage 3: h += rs * n_mo(partial + b_down (+ b_o: parallel)).
// Arguments as tgi_paged_decode_layer's (the same each stage, scratch included), hidden updated by stages 2 and 3
// (a bf16 hidden: widened by stage 1 into scratch, which carries it, rounded once by stage 3). An MoE MLP (of a
// sequential block): stage 2's partial sums are the rank's experts' slices (and shared expert's), routed alike.
int tgi_paged_decode_layer_stage(
    int stage, float* partial, const LayerSpec* spec, void* hidden, int64_t tokens, const void* cos,
    const void* sin, void* k_cache, void* v_cache, int64_t num_blocks, int64_t c_sblock, int64_t c_sslot,
    int64_t c_shead, const int64_t* slot_mapping, const void* block_tables, int bt_int64, int64_t bt_stride,
    int64_t bt_width, const void* seq_lens, int sl_int64, int block_size, float* scratch, int num_threads,
    const int32_t* query_start_loc, int64_t num_requests, const LayerLora* lora, int act_dtype, int kv_dtype) {
  const LayerSpec& S = *spec;
  const bool int8_columns = S.w_zeros[0] && S.w_zeros[1] && S.w_zeros[2] && S.w_zeros[3] && S.w_scales[0] &&
                            S.w_scales[1] && S.w_scales[2] && S.w_scales[3];
  if (stage < 0 || stage > 3 || (stage && (!partial || (S.experts > 0 && S.parallel))) ||
      (stage == 2 && S.parallel) ||
      S.weight_dtype < 0 || S.weight_dtype > 3 || (S.weight_dtype >= 2 && (!int8_columns || S.experts > 0)) ||
      act_dtype < 0 || act_dtype > 1 || kv_dtype < 0 || kv_dtype > 1 ||
      S.activation < 0 || S.activation > 3 || (S.experts > 0 && (!S.gated || !S.w_router || S.top_k < 1 ||
                                                                  S.top_k > S.experts || S.b_gate_up)) ||
      (S.shared_intermediate > 0 && (!S.experts || !S.w_shared_gate_up || !S.w_shared_down || !S.w_shared_gate)) || S.qk_norm < 0 || S.qk_norm > 2 ||
      (S.qk_norm && (!S.q_norm || !S.k_norm)) || S.rope < 0 || S.rope > 2 ||
      S.rotary_dim <= 0 || S.rotary_dim > S.head_dim || S.rotary_dim % 2 || (!S.gated && S.activation == 0) ||
      // parallel: the attention's normed input must survive its output (kept in scratch, added directly)
      (S.parallel && (!S.attn_in || S.attn_out || S.mlp_out || S.residual_scale != 1.0f)) ||
      (S.post_add && (S.parallel || S.residual_scale != 1.0f)) || (S.rope != 2 && (!cos || !sin)))
    return kBadSpec;
  const int64_t n_q = static_cast<int64_t>(S.num_q_heads) * S.head_dim;
  const int64_t n_qkv = n_q + 2 * static_cast<int64_t>(S.num_kv_heads) * S.head_dim;
  const int64_t lora_in[kLoraProjections] = {S.hidden_size, n_q, S.hidden_size, S.intermediate};
  const int64_t lora_out[kLoraProjections] = {n_qkv, S.hidden_size, (S.gated ? 2 : 1) * S.intermediate, S.hidden_size};
  if ((lora && stage) || !lora_fits(lora, tokens, lora_in, lora_out, S.experts > 0)) return kBadSpec;
  std::vector<int64_t> row_request, row_len;
  if (query_start_loc &&
      !query_rows(query_start_loc, num_requests, tokens, seq_lens, sl_int64, row_request, row_len))
    return kBadSpec;
  LoraGroups lora_groups;
  if (lora) group_rows(lora->token_slots, tokens, lora_groups);
  StepArgs A{static_cast<float*>(hidden), tokens, static_cast<const float*>(cos), static_cast<const float*>(sin),
             slot_mapping, scratch, stage, partial, lora, &lora_groups, nullptr, nullptr, nullptr};
  if (act_dtype == 1) {  // fp32 copies at the front of scratch; the layer's own scratch after them
    const int64_t H = S.hidden_size, R = S.rotary_dim;
    A.hidden_bf16 = static_cast<uint16_t*>(hidden);
    A.hidden = scratch;
    A.cos = S.rope == 2 ? nullptr : scratch + tokens * H;
    A.sin = S.rope == 2 ? nullptr : scratch + tokens * (H + R);
    A.cos_bf16 = S.rope == 2 ? nullptr : static_cast<const uint16_t*>(cos);
    A.sin_bf16 = S.rope == 2 ? nullptr : static_cast<const uint16_t*>(sin);
    A.scratch = scratch + tokens * (H + 2 * R);
  }
  DecodeArgs d{nullptr, 0, 0, static_cast<const char*>(k_cache), static_cast<const char*>(v_cache), nullptr,
                     c_sblock, c_sslot, c_shead, num_blocks, block_tables, bt_int64, bt_stride, bt_width,
                     seq_lens, sl_int64, nullptr, static_cast<int>(tokens), S.num_q_heads, S.num_kv_heads,
                     S.head_dim, block_size, S.scale, S.softcap, S.window, nullptr, 1.0f, 1.0f, S.head_dim};
  if (query_start_loc) {
    d.row_request = row_request.data();
    d.row_len = row_len.data();
  }
  return kv_dtype == 1 ? layer_dispatch_dim<1>(S, A, d, num_threads) : layer_dispatch_dim<0>(S, A, d, num_threads);
}

// One decode step of the decoder layer `spec` describes over T requests (one token each), fp32 arithmetic on
// weights packed in spec->weight_dtype (torch reference: cpu_layer_ref.decode_layer_ref):
//   h += rs * n_ao(o_proj(attention(rope(qk_norm(qkv_proj(n_ai(h)))))))
//   h += rs * n_mo(down(act(gate) * up)(n_mi(h)))
// or, parallel: h += o_proj(attention(...n_ai(h)...)) + mlp(n_mi(h)) (Cohere, Phi: n_mi is n_ai; GPT-NeoX).
// Norms are RMSNorms or (layer_norm) LayerNorms with optional biases (post_add: n_ao, n_mo norm h after each
// add, h = n(h + block), OPT's post-LN); rope: neox, interleaved or none (cos/sin unread, may be null), on the
// first rotary_dim values of each head; activation SiLU, GeLU-tanh, GeLU or ReLU; the MLP gated (act(gate) * up) or not (gelu_tanh(up): Phi); the o, MLP
// projections optionally biased.
// with n_* the spec's RMSNorms (identity where absent) and rs its residual scale. hidden [T, H] contiguous,
// updated in place; w_qkv packed [(Hq + 2 Hkv) D, H] (q, k, v heads in order) with optional bias; w_o
// [H, Hq D]; w_gate_up [2I, H] (gate rows first); w_down [H, I]; cos/sin [T, D]; the new K (after its
// norm and RoPE) and V are written to their slots of pools [num_blocks, block_size, Hkv, D] of kv_dtype (0
// fp32, 1 bf16: rounded to nearest even, read back widened; element
// strides c_sblock, c_sslot, c_shead; negative slots skipped) before request b attends over its
// seq_lens[b] positions (window > 0: the last `window`; softcap > 0: scores soft-capped). scratch:
// T * (2H + (2 Hq + 3 Hkv) D + Hq D + 3I) floats, plus T * (E + 4H) for an MoE MLP of E experts (experts > 0:
// w_router packed [E, H], w_gate_up / w_down each expert's packed [2I, H] / [H, I] in turn; top_k of the router's
// softmax, renormalized when norm_top_k), plus T * (3 Is + H + 1) for a shared expert of Is. Returns 0; 2 for a table too narrow for a seq_len, 3 for a
// block id outside the pool, 5 for a slot outside the pool, 6 for a spec this library does not know (or a
// LoRA or query_start_loc that does not fit).
// query_start_loc (int32 [num_requests + 1], null for one token per request): a step of several query rows per
// request (speculative verify: the last token and the draft), each row attending causally over its request's
// positions up to its own (block_tables and seq_lens per request, hidden and slot_mapping per row).
// lora (null: none; stage 0 only): the LoRA deltas of the rows' adapters, added to the projections' outputs.
// act_dtype 1: hidden and cos/sin are bf16 (a bf16 model's), widened at entry (scratch holds T * (H + 2R) more
// floats for them, R = rotary_dim) and hidden rounded to bf16 at exit; 0: fp32.
int tgi_paged_decode_layer(
    const LayerSpec* spec, void* hidden, int64_t tokens, const void* cos, const void* sin,
    void* k_cache, void* v_cache, int64_t num_blocks, int64_t c_sblock, int64_t c_sslot, int64_t c_shead,
    const int64_t* slot_mapping, const void* block_tables, int bt_int64, int64_t bt_stride, int64_t bt_width,
    const void* seq_lens, int sl_int64, int block_size, float* scratch, int num_threads,
    const int32_t* query_start_loc, int64_t num_requests, const LayerLora* lora, int act_dtype, int kv_dtype) {
  return tgi_paged_decode_layer_stage(0, nullptr, spec, hidden, tokens, cos, sin, k_cache, v_cache, num_blocks,
                                      c_sblock, c_sslot, c_shead, slot_mapping, block_tables, bt_int64, bt_stride,
                                      bt_width, seq_lens, sl_int64, block_size, scratch, num_threads,
                                      query_start_loc, num_requests, lora, act_dtype, kv_dtype);
}

// One decode step of n_layers whole layers in turn (a decoder's stack: tgi_paged_decode_layer each, hidden updated
// in place by one layer after the other): layer i's spec, pools, block table, slots and LoRA rows from specs[i],
// k_caches[i], v_caches[i], block_tables[i], slot_mappings[i], loras[i] (slot_mappings null: slot_mapping for every
// layer; loras null: no adapter rows); every other argument is the same for every layer (one token per request, or
// query_start_loc's rows: tgi_paged_decode_layer's). One native call per step instead of one per layer. Returns the
// first non-zero status, the layer that gave it in *failed_layer (earlier layers have written their K/V and
// updated hidden).
int tgi_paged_decode_layers(
    int64_t n_layers, const LayerSpec* const* specs, void* const* k_caches, void* const* v_caches,
    const void* const* block_tables, const LayerLora* const* loras, int64_t* failed_layer, void* hidden,
    int64_t tokens, const void* cos, const void* sin, int64_t num_blocks, int64_t c_sblock, int64_t c_sslot,
    int64_t c_shead, const int64_t* slot_mapping, const int64_t* const* slot_mappings, int bt_int64,
    int64_t bt_stride, int64_t bt_width,
    const void* seq_lens, int sl_int64, int block_size, float* scratch, int num_threads,
    const int32_t* query_start_loc, int64_t num_requests, int act_dtype, int kv_dtype) {
  for (int64_t i = 0; i < n_layers; ++i) {
    const int status = tgi_paged_decode_layer_stage(
        0, nullptr, specs[i], hidden, tokens, cos, sin, k_caches[i], v_caches[i], num_blocks, c_sblock, c_sslot,
        c_shead, slot_mappings ? slot_mappings[i] : slot_mapping, block_tables[i], bt_int64, bt_stride, bt_width,
        seq_lens, sl_int64, block_size, scratch, num_threads, query_start_loc,
        query_start_loc ? num_requests : tokens, loras ? loras[i] : nullptr, act_dtype, kv_dtype);
    if (status != 0) {
      *failed_layer = i;
      return status;
    }
  }
  return 0;
}

}  // extern "C"
