// Batched multi-LoRA rows on CPU, fp32: the shrink (xa = A[s] x) and expand (out += scale[s] * B[s] xa) of one
// row (the per-layer kernel, cpu_lora.cpp); the native decode layer's LoRA (cpu_layer.cpp): its targets (LayerLora:
// the adapters of each projection it runs) and lora_add_rows, which runs the rows of one adapter in groups over the
// register tiles of cpu_lora_tiles.h, one task per target and group. Torch references:
// tgi_paged_kernels.lora.lora_delta_reference, cpu_layer_ref.decode_layer_ref (lora=...).

#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_lora_tiles.h"

namespace {

constexpr int kLoraMaxRank = 256;  // per-row scratch of the shrink (on the stack of a task)
constexpr int64_t kLoraChunk = 256;  // outputs of one expand chunk (the delta stays in registers / L1)

// xa[r] = A[r, :] . x for r < rank: 16 lane sums over k (each in k order), then their sum in lane order, then the
// tail: an order the source fixes, so A in W = fp32 or bf16 (widened exactly) gives the same bits for the same
// values, whatever width the compiler vectorizes with.
template <typename W>
inline void lora_shrink_row(const float* x, const W* a, int rank, int64_t in_features, float* xa) {
  for (int r = 0; r < rank; ++r) {
    const W* ar = a + r * in_features;
    float lanes[16] = {};
    int64_t k = 0;
    for (; k + 16 <= in_features; k += 16) {
      for (int l = 0; l < 16; ++l) lanes[l] += x[k + l] * lora_value(ar + k + l);
    }
    float acc = 0.0f;
    for (int l = 0; l < 16; ++l) acc += lanes[l];
    for (; k < in_features; ++k) acc += x[k] * lora_value(ar + k);
    xa[r] = acc;
  }
}

// out[i] += scale * sum_r xa[r] * Bt[r, n0 + i] for i < width <= kLoraChunk (Bt: [rank, out_features] in W; out:
// the row's outputs from n0 on).
template <typename W>
inline void lora_expand_chunk(const float* xa, const W* bt, int rank, int64_t out_features, int64_t n0,
                              int64_t width, float scale, float* out) {
  float acc[kLoraChunk];
  for (int64_t i = 0; i < width; ++i) acc[i] = 0.0f;
  for (int r = 0; r < rank; ++r) {
    const float xr = xa[r];
    const W* btr = bt + r * out_features + n0;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) acc[i] += xr * lora_value(btr + i);
  }
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) out[i] += acc[i] * scale;
}

// The adapters of one LoRA-wrapped projection of a decoder layer (or of one projection's columns in a fused
// GEMM: q, k and v of w_qkv, gate and up of w_gate_up), stacked by slot as cpu_lora.cpp reads them. The ctypes
// mirror is cpu_layer_lora._Target, field for field.
struct LoraTarget {
  int32_t projection;  // 0 q/k/v (input: the attention's normed input), 1 o, 2 gate/up, 3 down
  int32_t max_rank;    // R <= kLoraMaxRank
  int64_t column, width;  // the projection's output columns [column, column + width) the delta adds to
  int64_t in_features, num_slots;
  const void* a;        // [S, R, in_features], in `dtype`
  const void* bt;       // [S, R, width] (B transposed), in `dtype`
  const float* scales;  // [S]
  const int32_t* ranks;  // [S], each <= R
  int32_t dtype;        // of A and B: 0 fp32, 1 bf16 (widened exactly in the tiles)
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
        g.dtype < 0 || g.dtype > 1 ||
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

// Asks for the n values from p into the cache ahead of their reads: a task's A and B (a few tens of KiB, one
// adapter's rows of one projection) are too short a stream for the hardware prefetcher to reach full speed.
template <typename W>
inline void lora_prefetch(const W* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64 / sizeof(W)) __builtin_prefetch(p + i, 0, 2);
}

// The delta of one target for one group of kRows rows of adapter slot s (rank > 0): the shrink into registers'
// scratch (xa: the rows' ranks), then the expand over all the target's columns, out_rows[j] its row j's first.
template <int kRows, typename W>
inline void lora_group_delta(const LoraTarget& g, int64_t s, const float* const x_rows[kRows],
                             float* const out_rows[kRows]) {
  const int rank = g.ranks[s];
  const W* a = static_cast<const W*>(g.a) + s * g.max_rank * g.in_features;
  const W* bt = static_cast<const W*>(g.bt) + s * g.max_rank * g.width;
  lora_prefetch(a, rank * g.in_features);
  lora_prefetch(bt, rank * g.width);
  float xa[kRows][kLoraMaxRank];
  float xa0[kRows], xa1[kRows];
  for (int r = 0; r < rank; r += 2) {  // two rows of A at a time, each vector of them for every row
    const bool pair = r + 1 < rank;
    lora_shrink_tile<kRows>(x_rows, a + r * g.in_features, a + (pair ? r + 1 : r) * g.in_features, g.in_features,
                            xa0, xa1);
    for (int j = 0; j < kRows; ++j) {
      xa[j][r] = xa0[j];
      if (pair) xa[j][r + 1] = xa1[j];
    }
  }
  const float* xa_rows[kRows];
  for (int j = 0; j < kRows; ++j) xa_rows[j] = xa[j];
  lora_expand_tile<kRows>(xa_rows, bt, g.width, rank, g.width, g.scales[s], out_rows);
}

// lora_group_delta for a group of `count` rows (1 .. kLoraGroup) of A and B in W.
template <typename W>
inline void lora_group_rows(int count, const LoraTarget& g, int64_t s, const float* const x_rows[kLoraTileRows],
                            float* const out_rows[kLoraTileRows]) {
  switch (count) {
    case 1: lora_group_delta<1, W>(g, s, x_rows, out_rows); break;
    case 2: lora_group_delta<2, W>(g, s, x_rows, out_rows); break;
    case 3: lora_group_delta<3, W>(g, s, x_rows, out_rows); break;
    case 4: lora_group_delta<4, W>(g, s, x_rows, out_rows); break;
    case 5: lora_group_delta<5, W>(g, s, x_rows, out_rows); break;
    case 6: lora_group_delta<6, W>(g, s, x_rows, out_rows); break;
    case 7: lora_group_delta<7, W>(g, s, x_rows, out_rows); break;
    default: lora_group_delta<8, W>(g, s, x_rows, out_rows); break;
  }
}

// Task `task` of lora_add_rows: target (task / G)-th of `projection`, group task % G.
inline void lora_task(const LayerLora* lora, const LoraGroups& groups, int projection, int64_t task, const float* x,
                      int64_t ldx, float* out, int64_t ldo) {
  const int64_t G = groups.count();
  int64_t i = 0;
  for (int64_t nth = task / G;; ++i)
    if (lora->targets[i].projection == projection && nth-- == 0) break;
  const LoraTarget& g = lora->targets[i];
  const int64_t grp = task % G;
  const int64_t* rows = groups.rows.data() + groups.starts[grp];
  const int count = static_cast<int>(groups.starts[grp + 1] - groups.starts[grp]);
  const int64_t s = lora->token_slots[rows[0]];
  if (g.ranks[s] == 0) return;
  const float* x_rows[kLoraTileRows];
  float* out_rows[kLoraTileRows];
  for (int j = 0; j < count; ++j) {
    x_rows[j] = x + rows[j] * ldx;
    out_rows[j] = out + rows[j] * ldo + g.column;
  }
  if (g.dtype == 1) {
    lora_group_rows<uint16_t>(count, g, s, x_rows, out_rows);
  } else {
    lora_group_rows<float>(count, g, s, x_rows, out_rows);
  }
}

// out[t, column:column + width] += each row's delta, for every target of `projection`, over the rows of input x
// (row stride ldx) and output out (row stride ldo) that `groups` holds (group_rows of the step's slots).
// Work-shared: called by every thread of a parallel region. One task per target of the projection and group of
// rows: its shrink, then its expand (no barrier between them; only the loop's closing one, none when `last`: the
// region's end is the barrier, and none at all when the projection has no target or the step no adapter row);
// tasks handed out one at a time, as their sizes differ (q's and k's widths, adapters' ranks). Each output value
// is one task's: the same bits on any thread count.
inline void lora_add_rows(const LayerLora* lora, const LoraGroups& groups, int projection, const float* x,
                          int64_t ldx, float* out, int64_t ldo, bool last = false) {
  const int64_t G = groups.count();
  if (G <= 0 || !lora_targets(lora, projection)) return;
  int64_t matching = 0;
  for (int64_t i = 0; i < lora->num_targets; ++i) matching += lora->targets[i].projection == projection;
  if (last) {
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t task = 0; task < matching * G; ++task) lora_task(lora, groups, projection, task, x, ldx, out, ldo);
  } else {
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < matching * G; ++task) lora_task(lora, groups, projection, task, x, ldx, out, ldo);
  }
}

}  // namespace
