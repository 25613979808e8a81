// The packed GEMMs as entry points of their own (NativeLinear's prefill and other steps, the tests): fp32
// weights (cpu_gemm.h) and bf16 weights (cpu_gemm_bf16.h), and an MoE block's SiLU experts on them given the
// router's picks (cpu_moe.h). Built into the library with cpu_layer.cpp (cpu_native.py). Torch references:
// cpu_layer_ref.gemm_packed_ref, cpu_layer_ref.gemm_packed_bf16_ref, cpu_layer_ref.moe_experts_ref.

#include "cpu_moe.h"

extern "C" {

// out[M, N] = a[M, K] @ W^T (+ bias) (+ add), W packed by cpu_layer.pack_weight. a, add and out row-major with
// the given row strides; bias [N] or null; add may be null or alias out.
int tgi_paged_gemm_packed(const float* a, int64_t lda, int64_t M, int64_t K, const float* packed, int64_t N,
                          const float* bias, const float* add, int64_t ldadd, float* out, int64_t ldo, int num_threads) {
#pragma omp parallel num_threads(num_threads)
  gemm_packed(a, lda, M, K, packed, N, bias, add, ldadd, out, ldo);
  return kOk;
}

// The same on a bf16 weight packed by cpu_gemm_bf16.pack_weight_bf16 ([ceil(N/16)][ceil(K/2)][16][2]).
int tgi_paged_gemm_packed_bf16(const float* a, int64_t lda, int64_t M, int64_t K, const uint16_t* packed, int64_t N,
                               const float* bias, const float* add, int64_t ldadd, float* out, int64_t ldo,
                               int num_threads) {
#pragma omp parallel num_threads(num_threads)
  gemm_packed_bf16(a, lda, M, K, packed, N, bias, add, ldadd, out, ldo);
  return kOk;
}

// Which arithmetic the bf16 GEMM does now: 1 when it rounds activations to bf16 and sums them with vdpbf16ps
// (AVX512-BF16, cpu_gemm_bf16_dot.h) or AMX tiles (cpu_gemm_amx.h), 0 when it widens the weights and sums fp32
// fused multiply-adds in k order.
int tgi_paged_gemm_bf16_rounds_activations() { return bf16_dot_active() || amx_active() ? 1 : 0; }

// The vdpbf16ps path turned on (1) or off (0: the widening path where AMX is off), or left as it is (-1); returns
// whether it is now on (0 where the build has no AVX512-BF16). AMX, where active, takes precedence.
int tgi_paged_gemm_bf16_dot(int on) {
  if (on >= 0) bf16_dot_switch().store(on != 0);
  return bf16_dot_active() ? 1 : 0;
}

// The AMX bf16 GEMM turned on (1, the default) or off (0: the widening or vdpbf16ps path), or left as it is
// (-1); returns whether it is now in use (0 where the build or the kernel has no AMX).
int tgi_paged_gemm_bf16_amx(int on) {
  if (on >= 0) amx_switch().store(on != 0);
  return amx_active() ? 1 : 0;
}

// out[T, H] = sum over each token's picks k of top_weight[t, k] * expert(top_index[t, k])(x[t]), the experts' SiLU
// gated MLPs packed in weight_dtype (0 fp32, 1 bf16) one after another (gate/up [2I, H] in w_gate_up, down [H, I]
// in w_down), added in expert order; a pick of `experts` is no expert. scratch: T * (2H + 3I) floats. Returns 1
// (nothing written) for a pick outside [0, experts] or an expert picked twice by one token.
int tgi_paged_moe_experts(const float* x, int64_t T, int64_t H, const int64_t* top_index, const float* top_weight,
                          int top_k, int experts, int64_t I, int weight_dtype, const void* w_gate_up,
                          const void* w_down, float* scratch, float* out, int num_threads) {
  MoeRouting routing;
  if (!group_by_expert(T, top_k, experts, top_index, top_weight, routing)) return 1;
  float *rows = scratch, *expert_out = rows + T * H, *gate_up = expert_out + T * H, *act = gate_up + T * 2 * I;
  const auto silu_rows = [I](const float* gu, float* a, int64_t n) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r) silu_mul_row_f32(gu + r * 2 * I, gu + r * 2 * I + I, a + r * I, I);
  };
#pragma omp parallel num_threads(num_threads)
  run_experts(x, T, H, I, weight_dtype, w_gate_up, w_down, routing, rows, expert_out, gate_up, act, out, silu_rows);
  return kOk;
}

}  // extern "C"
