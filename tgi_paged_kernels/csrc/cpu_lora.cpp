// Batched multi-LoRA delta on CPU, fp32 (torch reference: tgi_paged_kernels.lora.lora_delta_reference).
// One call per adapted layer and step, whatever the mix of adapters: each row t with slot s >= 0 gets
//   out[t, :] += scales[s] * (B[s] @ (A[s] @ x[t, :]))      over the slot's own rank ranks[s] <= R,
// rows with s < 0 are left as they are. A and B of one adapter are read once per row, from cache after the
// first row of that adapter (a decode step's rows of one adapter share them).
#include <cstdint>

namespace {
constexpr int kOk = 0;
constexpr int kBadSlot = 4;
constexpr int kMaxRank = 256;
}  // namespace

extern "C" {

// out fp32 [T, N] (row stride out_stride), x fp32 [T, K] (row stride x_stride), slots int64 [T],
// a_stack fp32 [S, R, K] and bt_stack fp32 [S, R, N] (B transposed, so the expand runs along N) contiguous,
// scales fp32 [S], ranks int32 [S] (<= R). Per output: a sequential sum over r, times the scale, added.
// Work is split by row over `num_threads` OpenMP threads when it is large enough to pay for them.
// Returns 0; 4 when a slot is >= S or a rank exceeds R or 256 (nothing is written then).
int tgi_paged_lora_add(float* out, int64_t out_stride, const float* x, int64_t x_stride, const int64_t* slots,
                       int64_t num_rows, int64_t in_features, int64_t out_features, const float* a_stack,
                       const float* bt_stack, int64_t num_slots, int64_t max_rank, const float* scales,
                       const int32_t* ranks, int num_threads) {
  if (max_rank > kMaxRank) return kBadSlot;
  for (int64_t t = 0; t < num_rows; ++t) {
    if (slots[t] >= num_slots) return kBadSlot;
  }
  for (int64_t s = 0; s < num_slots; ++s) {
    if (ranks[s] < 0 || ranks[s] > max_rank) return kBadSlot;
  }
  const int64_t work = num_rows * max_rank * (in_features + out_features);
  const int threads = work >= (int64_t{1} << 21) ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < num_rows; ++t) {
    const int64_t s = slots[t];
    if (s < 0 || ranks[s] == 0) continue;
    const int rank = ranks[s];
    const float* xr = x + t * x_stride;
    const float* a = a_stack + s * max_rank * in_features;
    float xa[kMaxRank];
    for (int r = 0; r < rank; ++r) {
      const float* ar = a + r * in_features;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < in_features; ++k) acc += xr[k] * ar[k];
      xa[r] = acc;
    }
    const float scale = scales[s];
    const float* bt = bt_stack + s * max_rank * out_features;
    float* orow = out + t * out_stride;
    constexpr int64_t kChunk = 256;  // the delta of kChunk outputs stays in registers / L1
    float acc[kChunk];
    for (int64_t n0 = 0; n0 < out_features; n0 += kChunk) {
      const int64_t width = out_features - n0 < kChunk ? out_features - n0 : kChunk;
      for (int64_t i = 0; i < width; ++i) acc[i] = 0.0f;
      for (int r = 0; r < rank; ++r) {
        const float xr_val = xa[r];
        const float* btr = bt + r * out_features + n0;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) acc[i] += xr_val * btr[i];
      }
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) orow[n0 + i] += acc[i] * scale;
    }
  }
  return kOk;
}

}  // extern "C"
