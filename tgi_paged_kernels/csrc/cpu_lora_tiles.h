// Register tiles of the native decode layer's LoRA (cpu_lora.h's lora_add_rows): a group of kRows <=
// kLoraTileRows rows of one adapter times 16 values, so that each vector of A or B read serves every row of the
// group. The row count is a template argument: a group of 2 rows computes 2 rows, not a padded 8. GCC vector
// extensions: one AVX-512 register per vector where the host has it, two AVX2 registers or scalar code elsewhere
// (the same source builds for every -march). Sums: 16 lane sums over k then their sum (shrink), a sum over r in
// order (expand), the same for every kRows; within the torch reference's tolerance
// (tests/kernels/test_cpu_layer_lora.py). A and B are fp32 or bf16 (W = uint16_t: each value widened exactly, its
// bits shifted into an fp32's top half), so bf16 stacks give the bits of fp32 stacks holding the same values.

#pragma once

#include <cstdint>
#include <type_traits>

namespace {

constexpr int kLoraTileRows = 8;
typedef float LoraVec __attribute__((vector_size(64)));
typedef float LoraVecUnaligned __attribute__((vector_size(64), aligned(4)));
typedef uint16_t LoraHalfUnaligned __attribute__((vector_size(32), aligned(2)));
typedef uint32_t LoraWord __attribute__((vector_size(64)));

// Vectors are read and written in place (no function passes or returns one: no vector ABI across -march levels).
#define TGI_LORA_VEC(p) (*reinterpret_cast<const LoraVecUnaligned*>(p))
#define TGI_LORA_VEC_OUT(p) (*reinterpret_cast<LoraVecUnaligned*>(p))
// 16 bf16 values as fp32 (the same-size vector cast is a bit cast).
#define TGI_LORA_BF16(p) \
  ((LoraVec)(__builtin_convertvector(*reinterpret_cast<const LoraHalfUnaligned*>(p), LoraWord) << 16))
// 16 values of A or B (fp32, or bf16 widened).
#define TGI_LORA_LOAD(W, p) (std::is_same_v<W, uint16_t> ? TGI_LORA_BF16(p) : TGI_LORA_VEC(p))

template <typename W>
inline float lora_value(const W* p) {
  if constexpr (std::is_same_v<W, uint16_t>) {
    const uint32_t bits = static_cast<uint32_t>(*p) << 16;
    float v;
    __builtin_memcpy(&v, &bits, sizeof(v));
    return v;
  } else {
    return *p;
  }
}

// out0[j] = x_j . a0 and out1[j] = x_j . a1 over K values, for the tile's rows j < kRows.
template <int kRows, typename W>
inline void lora_shrink_tile(const float* const x[kRows], const W* a0, const W* a1, int64_t K, float out0[kRows],
                             float out1[kRows]) {
  LoraVec acc0[kRows] = {}, acc1[kRows] = {};
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const LoraVec v0 = TGI_LORA_LOAD(W, a0 + k), v1 = TGI_LORA_LOAD(W, a1 + k);
    for (int j = 0; j < kRows; ++j) {
      const LoraVec vx = TGI_LORA_VEC(x[j] + k);
      acc0[j] += vx * v0;
      acc1[j] += vx * v1;
    }
  }
  for (int j = 0; j < kRows; ++j) {
    float s0 = 0.0f, s1 = 0.0f;
    for (int c = 0; c < 16; ++c) {
      s0 += acc0[j][c];
      s1 += acc1[j][c];
    }
    for (int64_t kk = k; kk < K; ++kk) {
      s0 += x[j][kk] * lora_value(a0 + kk);
      s1 += x[j][kk] * lora_value(a1 + kk);
    }
    out0[j] = s0;
    out1[j] = s1;
  }
}

// out_j[c] += scale * sum_r xa_j[r] * bt[r * ldb + c] for c < width and the tile's rows j < kRows.
template <int kRows, typename W>
inline void lora_expand_tile(const float* const xa[kRows], const W* bt, int64_t ldb, int rank, int64_t width,
                             float scale, float* const out[kRows]) {
  int64_t c0 = 0;
  for (; c0 + 16 <= width; c0 += 16) {
    LoraVec acc[kRows] = {};
    for (int r = 0; r < rank; ++r) {
      const LoraVec b = TGI_LORA_LOAD(W, bt + r * ldb + c0);
      for (int j = 0; j < kRows; ++j) acc[j] += xa[j][r] * b;
    }
    for (int j = 0; j < kRows; ++j) TGI_LORA_VEC_OUT(out[j] + c0) = TGI_LORA_VEC(out[j] + c0) + acc[j] * scale;
  }
  for (; c0 < width; ++c0) {
    for (int j = 0; j < kRows; ++j) {
      float total = 0.0f;
      for (int r = 0; r < rank; ++r) total += xa[j][r] * lora_value(bt + r * ldb + c0);
      out[j][c0] += total * scale;
    }
  }
}

}  // namespace

#undef TGI_LORA_VEC
#undef TGI_LORA_VEC_OUT
#undef TGI_LORA_BF16
#undef TGI_LORA_LOAD
