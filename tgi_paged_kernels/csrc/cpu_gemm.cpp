// The packed GEMMs as entry points of their own (NativeLinear's prefill and other steps, the tests): fp32
// weights (cpu_gemm.h) and bf16 weights (cpu_gemm_bf16.h). Built into the library with cpu_layer.cpp
// (cpu_native.py). Torch references: cpu_layer_ref.gemm_packed_ref, cpu_layer_ref.gemm_packed_bf16_ref.

#include "cpu_gemm_bf16.h"

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

// Which arithmetic this build's bf16 GEMM does now: 1 when it rounds activations to bf16 and sums them with
// vdpbf16ps (AVX512-BF16) or AMX tiles (cpu_gemm_amx.h), 0 when it widens the weights and sums fp32 fused
// multiply-adds in k order.
int tgi_paged_gemm_bf16_rounds_activations() { return kBf16Dot || amx_active() ? 1 : 0; }

// The AMX bf16 GEMM turned on (1, the default) or off (0: the widening or vdpbf16ps path), or left as it is
// (-1); returns whether it is now in use (0 where the build or the kernel has no AMX).
int tgi_paged_gemm_bf16_amx(int on) {
  if (on >= 0) amx_switch().store(on != 0);
  return amx_active() ? 1 : 0;
}

}  // extern "C"
