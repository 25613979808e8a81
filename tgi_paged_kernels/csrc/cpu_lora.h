// Batched multi-LoRA rows on CPU, fp32: the shrink (xa = A[s] x) and expand (out += scale[s] * B[s] xa) of one
// row (the per-layer kernel, cpu_lora.cpp); the native decode layer's LoRA (cpu_layer.cpp): its targets (LayerLora:
// the adapters of each projection it runs) and lora_add_rows, which runs the rows of one adapter in groups over the
// register tiles of cpu_lora_tiles.h. Torch references: tgi_paged_kernels.lora.lora_delta_reference,
// cpu_layer_ref.decode_layer_ref (lora=...).

#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_lora_tiles.h"

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

// The step's rows with an adapter, grouped by slot (up to kLoraGroup rows each), so that a group's rows share
// every read of the adapter's A and B rows (from memory once per group, not once per row).
constexpr int kLoraGroup = kLoraTileRows;
struct LoraGroups {
  std::vector<int64_t> rows;    // row ids, grouped
  std::vector<int64_t> starts;  // group g holds rows[starts[g] .. starts[g + 1])
  int64_t count() const { return static_cast<int64_t>(starts.size()) - 1; }
};

inline void group_rows(const int64_t* slots, int64_t T, LoraGroups& groups) {
  groups.rows.clear();
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] >= 0) groups.rows.push_back(t);
  std::stable_sort(groups.rows.begin(), groups.rows.end(), [slots](int64_t a, int64_t b) { return slots[a] < slots[b]; });
  groups.starts.assign(1, 0);
  for (size_t i = 0; i < groups.rows.size(); ++i) {
    const int64_t start = groups.starts.back();
    const bool full = static_cast<int64_t>(i) - start == kLoraGroup;
    if (i > 0 && (full || slots[groups.rows[i]] != slots[groups.rows[i - 1]])) groups.starts.push_back(i);
  }
  groups.starts.push_back(static_cast<int64_t>(groups.rows.size()));
  if (groups.rows.empty()) groups.starts.assign(1, 0);
}

// out[t, column:column + width] += each row's delta, for every target of `projection`, over T rows of input x
// (row stride ldx) and output out (row stride ldo); rows as `groups` holds them (group_rows of the step's slots).
// Work-shared: called by every thread of a parallel region; xa is scratch of lora_scratch_floats(lora, T)
// floats. Shrinks (one task per target and group), a barrier, then expands (one task per target, group and
// chunk of kLoraChunk outputs), each over the group's rows at once (cpu_lora_tiles.h).
inline void lora_add_rows(const LayerLora* lora, const LoraGroups& groups, int projection, const float* x,
                          int64_t ldx, int64_t T, float* out, int64_t ldo, float* xa) {
  if (!lora_targets(lora, projection)) return;
  const int64_t n = lora->num_targets, G = groups.count();
  const int64_t* slots = lora->token_slots;
  const int64_t stride = lora_max_rank(lora);
#pragma omp for schedule(static)
  for (int64_t task = 0; task < n * G; ++task) {
    const int64_t i = task / G, grp = task % G;
    const LoraTarget& g = lora->targets[i];
    const int64_t* rows = groups.rows.data() + groups.starts[grp];
    const int count = static_cast<int>(groups.starts[grp + 1] - groups.starts[grp]);
    const int64_t s = slots[rows[0]];
    if (g.projection != projection || g.ranks[s] == 0) continue;
    const float* a = g.a + s * g.max_rank * g.in_features;
    const float* x_rows[kLoraTileRows];
    for (int j = 0; j < kLoraTileRows; ++j) x_rows[j] = x + rows[j < count ? j : 0] * ldx;
    float xa0[kLoraTileRows], xa1[kLoraTileRows];
    for (int r = 0; r < g.ranks[s]; r += 2) {  // two rows of A at a time, each vector of them for every row
      const bool pair = r + 1 < g.ranks[s];
      lora_shrink_tile(x_rows, a + r * g.in_features, a + (pair ? r + 1 : r) * g.in_features, g.in_features, xa0,
                       xa1);
      for (int j = 0; j < count; ++j) {
        xa[(i * T + rows[j]) * stride + r] = xa0[j];
        if (pair) xa[(i * T + rows[j]) * stride + r + 1] = xa1[j];
      }
    }
  }
  int64_t chunks = 0;  // the widest target's chunks: every target gets as many tasks
  for (int64_t i = 0; i < n; ++i) chunks = std::max(chunks, (lora->targets[i].width + kLoraChunk - 1) / kLoraChunk);
#pragma omp for schedule(static)
  for (int64_t task = 0; task < n * G * chunks; ++task) {
    const int64_t i = task / (G * chunks), grp = (task / chunks) % G, n0 = (task % chunks) * kLoraChunk;
    const LoraTarget& g = lora->targets[i];
    const int64_t* rows = groups.rows.data() + groups.starts[grp];
    const int count = static_cast<int>(groups.starts[grp + 1] - groups.starts[grp]);
    const int64_t s = slots[rows[0]];
    if (g.projection != projection || g.ranks[s] == 0 || n0 >= g.width) continue;
    const int64_t width = std::min(kLoraChunk, g.width - n0);
    const float* xa_rows[kLoraTileRows];
    float* out_rows[kLoraTileRows];
    static const float kZeros[kLoraMaxRank] = {};
    for (int j = 0; j < kLoraTileRows; ++j) {
      xa_rows[j] = j < count ? xa + (i * T + rows[j]) * stride : kZeros;
      out_rows[j] = j < count ? out + rows[j] * ldo + g.column + n0 : nullptr;
    }
    lora_expand_tile(xa_rows, g.bt + s * g.max_rank * g.width + n0, g.width, g.ranks[s], width, g.scales[s],
                     out_rows, count);
  }
}

}  // namespace
