// Batched multi-LoRA delta on CPU, fp32 math over fp32 or bf16 A and B (torch reference:
// tgi_paged_kernels.lora.lora_delta_reference).
// One call per adapted layer and step, whatever the mix of adapters: each row t with slot s >= 0 gets
//   out[t, :] += scales[s] * (B[s] @ (A[s] @ x[t, :]))      over the slot's own rank ranks[s] <= R,
// rows with s < 0 are left as they are. A and B of one adapter are read once per row, from cache after the
// first row of that adapter (a decode step's rows of one adapter share them). The row code is cpu_lora.h's,
// which the native decode layer runs too.
#include <cstdint>

#include "cpu_lora.h"

namespace {
constexpr int kOk = 0;
constexpr int kBadSlot = 4;

template <typename W>
void lora_rows(float* out, int64_t out_stride, const float* x, int64_t x_stride, const int64_t* slots,
               int64_t num_rows, int64_t in_features, int64_t out_features, const W* a_stack, const W* bt_stack,
               int64_t max_rank, const float* scales, const int32_t* ranks, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < num_rows; ++t) {
    const int64_t s = slots[t];
    if (s < 0 || ranks[s] == 0) continue;
    const int rank = ranks[s];
    float xa[kLoraMaxRank];
    lora_shrink_row(x + t * x_stride, a_stack + s * max_rank * in_features, rank, in_features, xa);
    const W* bt = bt_stack + s * max_rank * out_features;
    for (int64_t n0 = 0; n0 < out_features; n0 += kLoraChunk) {
      const int64_t width = out_features - n0 < kLoraChunk ? out_features - n0 : kLoraChunk;
      lora_expand_chunk(xa, bt, rank, out_features, n0, width, scales[s], out + t * out_stride);
    }
  }
}
}  // namespace

extern "C" {

// out fp32 [T, N] (row stride out_stride), x fp32 [T, K] (row stride x_stride), slots int64 [T],
// a_stack [S, R, K] and bt_stack [S, R, N] (B transposed, so the expand runs along N) contiguous, both in
// `stack_dtype` (0 fp32, 1 bf16: widened exactly), scales fp32 [S], ranks int32 [S] (<= R). Per output: a
// sequential sum over r, times the scale, added.
// Work is split by row over `num_threads` OpenMP threads when it is large enough to pay for them.
// Returns 0; 4 when a slot is >= S or a rank exceeds R or 256, or for another stack dtype (nothing is written then).
int tgi_paged_lora_add(float* out, int64_t out_stride, const float* x, int64_t x_stride, const int64_t* slots,
                       int64_t num_rows, int64_t in_features, int64_t out_features, const void* a_stack,
                       const void* bt_stack, int64_t num_slots, int64_t max_rank, const float* scales,
                       const int32_t* ranks, int num_threads, int stack_dtype) {
  if (max_rank > kLoraMaxRank || stack_dtype < 0 || stack_dtype > 1) return kBadSlot;
  for (int64_t t = 0; t < num_rows; ++t) {
    if (slots[t] >= num_slots) return kBadSlot;
  }
  for (int64_t s = 0; s < num_slots; ++s) {
    if (ranks[s] < 0 || ranks[s] > max_rank) return kBadSlot;
  }
  const int64_t work = num_rows * max_rank * (in_features + out_features);
  const int threads = work >= (int64_t{1} << 21) ? num_threads : 1;
  if (stack_dtype == 1) {
    lora_rows(out, out_stride, x, x_stride, slots, num_rows, in_features, out_features,
              static_cast<const uint16_t*>(a_stack), static_cast<const uint16_t*>(bt_stack), max_rank, scales, ranks,
              threads);
  } else {
    lora_rows(out, out_stride, x, x_stride, slots, num_rows, in_features, out_features,
              static_cast<const float*>(a_stack), static_cast<const float*>(bt_stack), max_rank, scales, ranks,
              threads);
  }
  return kOk;
}

}  // extern "C"
