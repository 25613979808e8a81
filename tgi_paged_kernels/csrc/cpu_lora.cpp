// Batched multi-LoRA delta on CPU, fp32 math over fp32 or bf16 A and B (torch reference:
// tgi_paged_kernels.lora.lora_delta_reference).
// One call per adapted layer and step, whatever the mix of adapters: each row t with slot s >= 0 gets
//   out[t, :] += scales[s] * (B[s] @ (A[s] @ x[t, :]))      over the slot's own rank ranks[s] <= R,
// rows with s < 0 are left as they are. A and B of one adapter are read once per row, from cache after the
// first row of that adapter (a decode step's rows of one adapter share them). The row code is cpu_lora.h's,
// which the native decode layer runs too.
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "cpu_lora.h"

namespace {
constexpr int kBadSlot = 4;  // kOk: cpu_common.h

// X: the activations' storage, float or uint16_t (a bf16 model's: x widened per row, each output chunk widened,
// its delta added in fp32 and the sum rounded once, to nearest even).
template <typename W, typename X>
void lora_rows(X* out, int64_t out_stride, const X* x, int64_t x_stride, const int64_t* slots, int64_t num_rows,
               int64_t in_features, int64_t out_features, const W* a_stack, const W* bt_stack, int64_t max_rank,
               const float* scales, const int32_t* ranks, int threads) {
  constexpr bool kWide = std::is_same_v<X, float>;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> row(kWide ? 0 : in_features);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_rows; ++t) {
      const int64_t s = slots[t];
      if (s < 0 || ranks[s] == 0) continue;
      const int rank = ranks[s];
      float xa[kLoraMaxRank];
      const float* xt;
      if constexpr (kWide) {
        xt = x + t * x_stride;
      } else {
        for (int64_t k = 0; k < in_features; ++k) row[k] = bf16_to_float(x[t * x_stride + k]);
        xt = row.data();
      }
      lora_shrink_row(xt, a_stack + s * max_rank * in_features, rank, in_features, xa);
      const W* bt = bt_stack + s * max_rank * out_features;
      for (int64_t n0 = 0; n0 < out_features; n0 += kLoraChunk) {
        const int64_t width = out_features - n0 < kLoraChunk ? out_features - n0 : kLoraChunk;
        if constexpr (kWide) {
          lora_expand_chunk(xa, bt, rank, out_features, n0, width, scales[s], out + t * out_stride + n0);
        } else {
          float chunk[kLoraChunk];
          X* o = out + t * out_stride + n0;
          for (int64_t i = 0; i < width; ++i) chunk[i] = bf16_to_float(o[i]);
          lora_expand_chunk(xa, bt, rank, out_features, n0, width, scales[s], chunk);
          for (int64_t i = 0; i < width; ++i) o[i] = float_to_bf16(chunk[i]);
        }
      }
    }
  }
}

template <typename X>
void lora_rows_of(void* out, int64_t out_stride, const void* x, int64_t x_stride, const int64_t* slots,
                  int64_t num_rows, int64_t in_features, int64_t out_features, const void* a_stack,
                  const void* bt_stack, int64_t max_rank, const float* scales, const int32_t* ranks, int threads,
                  int stack_dtype) {
  X* o = static_cast<X*>(out);
  const X* xs = static_cast<const X*>(x);
  if (stack_dtype == 1) {
    lora_rows(o, out_stride, xs, x_stride, slots, num_rows, in_features, out_features,
              static_cast<const uint16_t*>(a_stack), static_cast<const uint16_t*>(bt_stack), max_rank, scales, ranks,
              threads);
  } else {
    lora_rows(o, out_stride, xs, x_stride, slots, num_rows, in_features, out_features,
              static_cast<const float*>(a_stack), static_cast<const float*>(bt_stack), max_rank, scales, ranks,
              threads);
  }
}
}  // namespace

extern "C" {

// out [T, N] (row stride out_stride) and x [T, K] (row stride x_stride) in `act_dtype` (0 fp32; 1 bf16: widened,
// each sum rounded once to nearest even), slots int64 [T], a_stack [S, R, K] and bt_stack [S, R, N] (B transposed,
// so the expand runs along N) contiguous, both in `stack_dtype` (0 fp32, 1 bf16: widened exactly), scales fp32
// [S], ranks int32 [S] (<= R). Per output: a sequential sum over r, times the scale, added.
// Work is split by row over `num_threads` OpenMP threads when it is large enough to pay for them.
// Returns 0; 4 when a slot is >= S or a rank exceeds R or 256, or for another dtype (nothing is written then).
int tgi_paged_lora_add(void* out, int64_t out_stride, const void* x, int64_t x_stride, const int64_t* slots,
                       int64_t num_rows, int64_t in_features, int64_t out_features, const void* a_stack,
                       const void* bt_stack, int64_t num_slots, int64_t max_rank, const float* scales,
                       const int32_t* ranks, int num_threads, int stack_dtype, int act_dtype) {
  if (max_rank > kLoraMaxRank || stack_dtype < 0 || stack_dtype > 1 || act_dtype < 0 || act_dtype > 1)
    return kBadSlot;
  for (int64_t t = 0; t < num_rows; ++t) {
    if (slots[t] >= num_slots) return kBadSlot;
  }
  for (int64_t s = 0; s < num_slots; ++s) {
    if (ranks[s] < 0 || ranks[s] > max_rank) return kBadSlot;
  }
  const int64_t work = num_rows * max_rank * (in_features + out_features);
  const int threads = work >= (int64_t{1} << 21) ? num_threads : 1;
  if (act_dtype == 1) {
    lora_rows_of<uint16_t>(out, out_stride, x, x_stride, slots, num_rows, in_features, out_features, a_stack,
                           bt_stack, max_rank, scales, ranks, threads, stack_dtype);
  } else {
    lora_rows_of<float>(out, out_stride, x, x_stride, slots, num_rows, in_features, out_features, a_stack, bt_stack,
                        max_rank, scales, ranks, threads, stack_dtype);
  }
  return kOk;
}

}  // extern "C"
