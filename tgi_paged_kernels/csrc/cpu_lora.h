// Batched multi-LoRA rows on CPU, fp32: the shrink (xa = A[s] x) and expand (out += scale[s] * B[s] xa) of one
// row, shared by the per-layer kernel (cpu_lora.cpp) and the native decode layer (cpu_layer.cpp), so both give a
// row the same bits; and the decode layer's LoRA targets (LayerLora: the adapters of each projection it runs).
// Torch references: tgi_paged_kernels.lora.lora_delta_reference, cpu_layer_ref.decode_layer_ref (lora=...).

#pragma once

#include <algorithm>
#include <cstdint>

namespace {

constexpr int kLoraMaxRank = 256;  // per-row scratch of the shrink
constexpr int64_t kLoraChunk = 256;  // outputs of one expand chunk (the delta stays in registers / L1)

// xa[r] = A[r, :] . x for r < rank: each a sequential (vectorized) sum over k.
inline void lora_shrink_row(const float* x, const float* a, int rank, int64_t in_features, float* xa) {
  for (int r = 0; r < rank; ++r) {
    const float* ar = a + r * in_features;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t k = 0; k < in_features; ++k) acc += x[k] * ar[k];
    xa[r] = acc;
  }
}

// out[n0 + i] += scale * sum_r xa[r] * Bt[r, n0 + i] for i < width <= kLoraChunk (Bt: [rank, out_features]).
inline void lora_expand_chunk(const float* xa, const float* bt, int rank, int64_t out_features, int64_t n0,
                              int64_t width, float scale, float* out) {
  float acc[kLoraChunk];
  for (int64_t i = 0; i < width; ++i) acc[i] = 0.0f;
  for (int r = 0; r < rank; ++r) {
    const float xr = xa[r];
    const float* btr = bt + r * out_features + n0;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) acc[i] += xr * btr[i];
  }
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) out[n0 + i] += acc[i] * scale;
}

// The adapters of one LoRA-wrapped projection of a decoder layer (or of one projection's columns in a fused
// GEMM: q, k and v of w_qkv, gate and up of w_gate_up), stacked by slot as cpu_lora.cpp reads them. The ctypes
// mirror is cpu_layer_lora._Target, field for field.
struct LoraTarget {
  int32_t projection;  // 0 q/k/v (input: the attention's normed input), 1 o, 2 gate/up, 3 down
  int32_t max_rank;    // R <= kLoraMaxRank
  int64_t column, width;  // the projection's output columns [column, column + width) the delta adds to
  int64_t in_features, num_slots;
  const float* a;       // [S, R, in_features]
  const float* bt;      // [S, R, width] (B transposed)
  const float* scales;  // [S]
  const int32_t* ranks;  // [S], each <= R
};

// A decode step's LoRA (cpu_layer_lora.LayerLora): the layer's targets and the adapter slot of each row
// (< 0: the base model, no delta).
struct LayerLora {
  int64_t num_targets;
  const LoraTarget* targets;
  const int64_t* token_slots;  // [T]
};

constexpr int kLoraProjections = 4;

// Whether `lora` fits a step of T rows of a layer whose projections p read in[p] and write out[p] values: slots
// below every target's slot count, ranks within R <= 256, each target's columns within its projection's, and no
// target on an MoE MLP's projections (`experts`: their experts take no LoRA here).
inline bool lora_fits(const LayerLora* lora, int64_t T, const int64_t* in, const int64_t* out, bool experts) {
  if (!lora) return true;
  if (lora->num_targets < 0 || (lora->num_targets > 0 && (!lora->targets || !lora->token_slots))) return false;
  for (int64_t i = 0; i < lora->num_targets; ++i) {
    const LoraTarget& g = lora->targets[i];
    if (g.projection < 0 || g.projection >= kLoraProjections || g.max_rank < 0 || g.max_rank > kLoraMaxRank ||
        g.column < 0 || g.width <= 0 || !g.a || !g.bt || !g.scales || !g.ranks ||
        g.in_features != in[g.projection] || g.column + g.width > out[g.projection] || (experts && g.projection >= 2))
      return false;
    for (int64_t s = 0; s < g.num_slots; ++s)
      if (g.ranks[s] < 0 || g.ranks[s] > g.max_rank) return false;
    for (int64_t t = 0; t < T; ++t)
      if (lora->token_slots[t] >= g.num_slots) return false;
  }
  return true;
}

// The widest rank of the layer's targets (the stride of lora_add_rows' scratch rows).
inline int64_t lora_max_rank(const LayerLora* lora) {
  int64_t rank = 0;
  for (int64_t i = 0; lora && i < lora->num_targets; ++i) rank = std::max<int64_t>(rank, lora->targets[i].max_rank);
  return rank;
}

// Scratch floats of lora_add_rows for T rows: one row of ranks per target and row.
inline int64_t lora_scratch_floats(const LayerLora* lora, int64_t T) {
  return lora ? lora->num_targets * T * lora_max_rank(lora) : 0;
}

// Whether some target of `lora` adds to `projection`.
inline bool lora_targets(const LayerLora* lora, int projection) {
  if (!lora) return false;
  for (int64_t i = 0; i < lora->num_targets; ++i)
    if (lora->targets[i].projection == projection) return true;
  return false;
}

// out[t, column:column + width] += each row's delta, for every target of `projection`, over T rows of input x
// (row stride ldx) and output out (row stride ldo). Work-shared: called by every thread of a parallel region;
// xa is scratch of lora_scratch_floats(lora, T) floats. Shrinks (one task per target and row), a
// barrier, then expands (one task per target, row and chunk of kLoraChunk outputs).
inline void lora_add_rows(const LayerLora* lora, int projection, const float* x, int64_t ldx, int64_t T,
                          float* out, int64_t ldo, float* xa) {
  if (!lora_targets(lora, projection)) return;
  const int64_t n = lora->num_targets;
  const int64_t* slots = lora->token_slots;
  const int64_t stride = lora_max_rank(lora);
#pragma omp for schedule(static)
  for (int64_t task = 0; task < n * T; ++task) {
    const LoraTarget& g = lora->targets[task / T];
    const int64_t t = task % T, s = slots[t];
    if (g.projection != projection || s < 0 || g.ranks[s] == 0) continue;
    lora_shrink_row(x + t * ldx, g.a + s * g.max_rank * g.in_features, g.ranks[s], g.in_features,
                    xa + task * stride);
  }
  int64_t chunks = 0;  // the widest target's chunks: every target gets as many tasks
  for (int64_t i = 0; i < n; ++i) chunks = std::max(chunks, (lora->targets[i].width + kLoraChunk - 1) / kLoraChunk);
#pragma omp for schedule(static)
  for (int64_t task = 0; task < n * T * chunks; ++task) {
    const int64_t row_task = task / chunks, n0 = (task % chunks) * kLoraChunk;
    const LoraTarget& g = lora->targets[row_task / T];
    const int64_t t = row_task % T, s = slots[t];
    if (g.projection != projection || s < 0 || g.ranks[s] == 0 || n0 >= g.width) continue;
    const int64_t width = std::min(kLoraChunk, g.width - n0);
    lora_expand_chunk(xa + row_task * stride, g.bt + s * g.max_rank * g.width, g.ranks[s], g.width, n0, width,
                      g.scales[s], out + t * ldo + g.column);
  }
}

}  // namespace
