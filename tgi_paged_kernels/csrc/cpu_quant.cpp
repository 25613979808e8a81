// Entry points of the quantized-weight GEMM (cpu_gemm_quant.h). Built into the same library as cpu_kernels.cpp
// (cpu_native.py). Torch reference: tgi_paged_kernels.cpu_quant.gemm_packed_int8_ref.

#include "cpu_gemm_quant.h"

extern "C" {

// out[M, N] = a[M, K] @ ((codes - zeros) * scales)^T (+ bias) (+ add): codes packed [ceil(N / 16)][K][16] uint8,
// zeros and scales fp32 per packed column (cpu_quant.pack_int8); a, add and out row-major with the given row
// strides; bias [N] or null; add may be null or alias out. Returns 0.
int tgi_paged_gemm_packed_i8(const float* a, int64_t lda, int64_t M, int64_t K, const uint8_t* codes,
                             const float* zeros, const float* scales, int64_t N, const float* bias, const float* add,
                             int64_t ldadd, float* out, int64_t ldo, int num_threads) {
#pragma omp parallel num_threads(num_threads)
  gemm_packed_i8<false>(a, lda, M, K, codes, zeros, scales, N, bias, add, ldadd, out, ldo);
  return kOk;
}

// The same for fp8 e4m3 codes: out = a @ (e4m3(codes) * scales)^T (+ bias) (+ add); zeros unused (may be null).
// Returns 0.
int tgi_paged_gemm_packed_f8(const float* a, int64_t lda, int64_t M, int64_t K, const uint8_t* codes,
                             const float* zeros, const float* scales, int64_t N, const float* bias, const float* add,
                             int64_t ldadd, float* out, int64_t ldo, int num_threads) {
  (void)zeros;
#pragma omp parallel num_threads(num_threads)
  gemm_packed_i8<true>(a, lda, M, K, codes, scales, scales, N, bias, add, ldadd, out, ldo);
  return kOk;
}

}  // extern "C"
