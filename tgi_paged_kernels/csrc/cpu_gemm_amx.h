// The bf16-weight GEMM on AMX tiles (cpu_gemm_bf16.h's gemm_packed_bf16 takes it where the host has AMX-BF16,
// the kernel may use the tiles and the switch is on). The weight is the VNNI packing of cpu_gemm_bf16.h
// ([ceil(N / 16)][ceil(K / 2)][16][2] bf16): 16 k pairs of one column block are 1 KiB, exactly one B tile
// (16 rows of 16 columns x 2). The activations are rounded to bf16 (RNE, as a torch bf16 model holds them) into a
// zero-padded [rows][32 k] buffer shared by the team: the A tiles; tdpbf16ps sums each tile's products into fp32
// C tiles (16 x 16); then the epilogue of gemm_packed (bias, add). A pass computes 2 row tiles x 2 column blocks
// (C tiles 0-3, A tiles 4-5, B tiles 6-7); a weight tail of fewer than 16 k pairs goes through a zeroed copy,
// so no tile reads past a panel. Each row's result is one fp32 sum over its k in a fixed order whatever its
// batch. Linux lends the tiles' state only after arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked
// once per process (amx_permitted); where that fails, or the build has no AMX (-march without amx-tile,
// amx-bf16), kAmxBuilt / amx_active say so and the caller keeps its widening path.
// Torch reference: cpu_layer_ref.gemm_packed_bf16_ref(rounds_activations=True) within fp32 summation tolerance.

#pragma once

#include <atomic>

#include "cpu_gemm.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#define TGI_PAGED_AMX 1
#endif

namespace tgi_paged {

// The runtime switch (tgi_paged_gemm_bf16_amx): tests compare the AMX GEMM with the widening one in one process.
// On by default; it only matters where the build and the kernel allow AMX. An inline function of external
// linkage: one switch for every source file of the library (an anonymous namespace would give each its own).
inline std::atomic<bool>& amx_switch() {
  static std::atomic<bool> on{true};
  return on;
}

}  // namespace tgi_paged

namespace {

using tgi_paged::amx_switch;

#if defined(TGI_PAGED_AMX)
constexpr bool kAmxBuilt = true;
constexpr int64_t kAmxRows = 16;   // rows of an A or C tile
constexpr int64_t kAmxPairs = 16;  // k pairs of an A or B tile (64 bytes a row)
constexpr int64_t kAmxMC = 128;    // rows of a task at most (balanced_row_chunk): its B panel is reused across them

// Whether Linux lets this process use the tile data (asked once; the permission is the whole process's).
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

inline bool amx_active() { return amx_switch().load(std::memory_order_relaxed) && amx_permitted(); }

struct alignas(64) AmxTileConfig {  // ldtilecfg's 64-byte layout, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes (loaded per call: another library, oneDNN, may have configured others).
inline void amx_configure() {
  AmxTileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = kAmxRows;
  _tile_loadconfig(&cfg);
}

// Rows [0, Mpad) of `dst` ([Mpad][2 * K2pad] bf16): the activations rounded (RNE), zeros past M and K.
inline void amx_round_rows(const float* a, int64_t lda, int64_t M, int64_t K, int64_t Mpad, int64_t K2pad,
                           uint16_t* dst) {
  const int64_t width = 2 * K2pad;
#pragma omp for schedule(static)
  for (int64_t m = 0; m < Mpad; ++m) {
    uint16_t* d = dst + m * width;
    for (int64_t k = 0; k < width; k += 16) {
      const int64_t n = m < M ? std::clamp<int64_t>(K - k, 0, 16) : 0;
      const __m512 v = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), a + m * lda + k);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + k), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    }
  }
}

// One pass: C[RT * 16 rows][NB * 16 columns] = A rows x the NB blocks at `w` (block stride `block_elems`),
// stored to c ([32][32] fp32). `tail` (NB x 1 KiB, zeros past its pairs) takes each block's last k pairs when
// K2 is not a multiple of 16.
template <int RT, int NB>
inline void amx_pass(const uint16_t* a16, int64_t a_bytes, int64_t K2, const uint16_t* w, int64_t block_elems,
                     uint16_t* tail, float* c) {
  constexpr int64_t kTileElems = kAmxPairs * 2 * kNB;  // bf16 values of a B tile
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (RT > 1) _tile_zero(2);
  if constexpr (RT > 1 && NB > 1) _tile_zero(3);
  const int64_t full = K2 / kAmxPairs, left = K2 % kAmxPairs;
  const uint16_t* a1 = a16 + kAmxRows * (a_bytes / 2);
  for (int64_t s = 0; s <= full; ++s) {
    const uint16_t *b0 = w + s * kTileElems, *b1 = b0 + block_elems;
    if (s == full) {  // the tail: the blocks' last pairs copied before zeros
      if (left == 0) break;
      std::memcpy(tail, b0, left * 2 * kNB * 2);
      if constexpr (NB > 1) std::memcpy(tail + kTileElems, b1, left * 2 * kNB * 2);
      b0 = tail, b1 = tail + kTileElems;
    }
    for (int64_t line = 0; line < kTileElems; line += 32) {  // the next pair's tiles of this step (two 1 KiB)
      _mm_prefetch(reinterpret_cast<const char*>(w + 2 * block_elems + s * kTileElems + line), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(w + 3 * block_elems + s * kTileElems + line), _MM_HINT_T1);
    }
    _tile_loadd(4, a16 + s * 2 * kAmxPairs, a_bytes);
    _tile_loadd(6, b0, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB > 1) {
      _tile_loadd(7, b1, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (RT > 1) {
      _tile_loadd(5, a1 + s * 2 * kAmxPairs, a_bytes);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NB > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t ldc = 2 * kNB * 4;  // bytes of a row of c
  _tile_stored(0, c, ldc);
  if constexpr (NB > 1) _tile_stored(1, c + kNB, ldc);
  if constexpr (RT > 1) _tile_stored(2, c + kAmxRows * 2 * kNB, ldc);
  if constexpr (RT > 1 && NB > 1) _tile_stored(3, c + kAmxRows * 2 * kNB + kNB, ldc);
}

// out[M, N] = a[M, K] @ W^T (+ bias) (+ add) as gemm_packed_bf16, on tiles; called by every thread of the team
// (orphaned work sharing; the rounded activations are allocated by one thread and shared).
void gemm_packed_bf16_amx(const float* a, int64_t lda, int64_t M, int64_t K, const uint16_t* packed, int64_t N,
                          const float* bias, const float* add, int64_t ldadd, float* out, int64_t ldo) {
  if (M == 0) return;  // an expert without rows (cpu_moe.h): no buffer, no barriers (every thread sees M)
  const int64_t K2 = (K + 1) / 2, K2pad = (K2 + kAmxPairs - 1) / kAmxPairs * kAmxPairs;
  const int64_t Mpad = (M + 2 * kAmxRows - 1) / (2 * kAmxRows) * (2 * kAmxRows);
  const int64_t block_elems = K2 * 2 * kNB, blocks = (N + kNB - 1) / kNB, pairs = (blocks + 1) / 2;
  const int64_t a_bytes = 2 * K2pad * 2;
  uint16_t* a16 = nullptr;
#pragma omp single copyprivate(a16)
  a16 = static_cast<uint16_t*>(std::aligned_alloc(64, static_cast<size_t>(Mpad * a_bytes + 63) / 64 * 64));
  amx_round_rows(a, lda, M, K, Mpad, K2pad, a16);  // ends with the team's barrier
  amx_configure();
  alignas(64) float c[2 * kAmxRows][2 * kNB];
  alignas(64) uint16_t tail[2][kAmxPairs * 2 * kNB] = {};
  gemm_tasks(M, K, pairs, 2 * kAmxRows, kAmxMC, [&](int64_t pair, int64_t m_begin, int64_t m_end) {
    const int64_t nb = 2 * pair, n0 = nb * kNB;
    const bool two_blocks = nb + 1 < blocks;
    const uint16_t* w = packed + nb * block_elems;
    for (int64_t m0 = m_begin; m0 < m_end; m0 += 2 * kAmxRows) {
      const uint16_t* a_rows = a16 + m0 * (a_bytes / 2);
      const int64_t rows = std::min<int64_t>(2 * kAmxRows, m_end - m0);
      const bool two_tiles = rows > kAmxRows;
      if (two_tiles && two_blocks) amx_pass<2, 2>(a_rows, a_bytes, K2, w, block_elems, tail[0], c[0]);
      if (two_tiles && !two_blocks) amx_pass<2, 1>(a_rows, a_bytes, K2, w, block_elems, tail[0], c[0]);
      if (!two_tiles && two_blocks) amx_pass<1, 2>(a_rows, a_bytes, K2, w, block_elems, tail[0], c[0]);
      if (!two_tiles && !two_blocks) amx_pass<1, 1>(a_rows, a_bytes, K2, w, block_elems, tail[0], c[0]);
      for (int j = 0; j < (two_blocks ? 2 : 1); ++j) {  // the epilogue's arithmetic, 16 lanes at once
        const int64_t n = n0 + j * kNB;
        const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(kNB, N - n)) - 1u);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
        for (int64_t r = 0; r < rows; ++r) {
          __m512 v = _mm512_load_ps(c[r] + j * kNB);
          if (bias) v = _mm512_add_ps(v, b);
          if (add) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, add + (m0 + r) * ldadd + n), v);
          _mm512_mask_storeu_ps(out + (m0 + r) * ldo + n, mask, v);
        }
      }
    }
  });  // the team's barrier: no thread still reads a16
  _tile_release();
#pragma omp single nowait
  std::free(a16);
}
#else
constexpr bool kAmxBuilt = false;
inline bool amx_permitted() { return false; }
inline bool amx_active() { return false; }
inline void gemm_packed_bf16_amx(const float*, int64_t, int64_t, int64_t, const uint16_t*, int64_t, const float*,
                                 const float*, int64_t, float*, int64_t) {}
#endif

}  // namespace
