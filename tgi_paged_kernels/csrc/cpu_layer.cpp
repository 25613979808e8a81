// A Llama-form decoder layer's decode step as one call (fp32), and the GEMM it runs on weights packed once.
// Built into the same library as cpu_kernels.cpp (cpu_native.py). Torch references:
// tgi_paged_kernels.cpu_layer_ref (gemm_packed_ref, llama_decode_layer_ref), compared in
// tests/kernels/test_cpu_layer.py.
//
// Packed weights: a [N, K] weight (torch's nn.Linear layout) as [ceil(N / 16)][K][16], columns padded with
// zeros (pack_weight in cpu_native.py). Every output is one sequential sum over k of fused multiply-adds,
// whatever the ISA (AVX-512, AVX2 + FMA, scalar) and the number of rows or threads: a row's result does not
// depend on the batch it is in.

#include "cpu_common.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int kNB = 16;  // columns of a packed block

// out[j] = add[j] + (c[j] + bias[j]) for the `cols` valid columns of a block (bias/add may be null).
inline void epilogue(const float* c, const float* bias, const float* add, float* out, int cols) {
  for (int j = 0; j < cols; ++j) {
    float v = c[j];
    if (bias) v += bias[j];
    out[j] = add ? add[j] + v : v;
  }
}

// tile<R>: rows [0, R) of one column block, acc[r] = sum_k a[r, k] * w[k, :] (fused multiply-adds in k
// order), written through the epilogue's arithmetic to `out`.
#if defined(__AVX512F__)
constexpr int kMR = 12;  // rows per register tile of one block: 12 accumulators of 16 lanes
constexpr int kMR2 = 8;  // rows per register tile of two blocks: 16 accumulators, one broadcast per two FMAs
constexpr bool kPairs = true;

inline void store_rows(const __m512* acc, int rows, const float* bias, const float* add, int64_t ldadd, float* out,
                       int64_t ldo, int cols) {  // the epilogue's arithmetic, 16 lanes at once
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r) {
    __m512 v = bias ? _mm512_add_ps(acc[r], b) : acc[r];
    if (add) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, add + r * ldadd), v);
    _mm512_mask_storeu_ps(out + r * ldo, mask, v);
  }
}

template <int R>
inline void tile(const float* a, int64_t lda, int64_t K, const float* w, const float* bias, const float* add,
                 int64_t ldadd, float* out, int64_t ldo, int cols) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 wk = _mm512_loadu_ps(w + k * kNB);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r * lda + k]), wk, acc[r]);
  }
  store_rows(acc, R, bias, add, ldadd, out, ldo, cols);
}

// Two neighbouring column blocks (w0, then w1 = the next block; the second has `cols1` valid columns).
template <int R>
inline void tile2(const float* a, int64_t lda, int64_t K, const float* w0, const float* w1, const float* bias,
                  const float* add, int64_t ldadd, float* out, int64_t ldo, int cols1) {
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 x0 = _mm512_loadu_ps(w0 + k * kNB), x1 = _mm512_loadu_ps(w1 + k * kNB);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * lda + k]);
      acc0[r] = _mm512_fmadd_ps(x, x0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(x, x1, acc1[r]);
    }
  }
  store_rows(acc0, R, bias, add, ldadd, out, ldo, kNB);
  store_rows(acc1, R, bias ? bias + kNB : nullptr, add ? add + kNB : nullptr, ldadd, out + kNB, ldo, cols1);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kMR = 6;  // 6 rows x 2 halves of 8 lanes: 12 accumulators
constexpr int kMR2 = 1;
constexpr bool kPairs = false;
template <int R>
inline void tile(const float* a, int64_t lda, int64_t K, const float* w, const float* bias, const float* add,
                 int64_t ldadd, float* out, int64_t ldo, int cols) {
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(w + k * kNB), w1 = _mm256_loadu_ps(w + k * kNB + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_set1_ps(a[r * lda + k]);
      lo[r] = _mm256_fmadd_ps(x, w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(x, w1, hi[r]);
    }
  }
  float c[kNB];
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c, lo[r]);
    _mm256_storeu_ps(c + 8, hi[r]);
    epilogue(c, bias, add ? add + r * ldadd : nullptr, out + r * ldo, cols);
  }
}
#else
constexpr int kMR = 4;
constexpr int kMR2 = 1;
constexpr bool kPairs = false;
template <int R>
inline void tile(const float* a, int64_t lda, int64_t K, const float* w, const float* bias, const float* add,
                 int64_t ldadd, float* out, int64_t ldo, int cols) {
  float acc[R][kNB] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kNB; ++j) acc[r][j] = std::fma(a[r * lda + k], w[k * kNB + j], acc[r][j]);
  for (int r = 0; r < R; ++r) epilogue(acc[r], bias, add ? add + r * ldadd : nullptr, out + r * ldo, cols);
}
#endif

template <int R>
inline void tile_rows(int rows, const float* a, int64_t lda, int64_t K, const float* w, const float* bias,
                      const float* add, int64_t ldadd, float* out, int64_t ldo, int cols) {
  if (rows == R) {
    tile<R>(a, lda, K, w, bias, add, ldadd, out, ldo, cols);
  } else if constexpr (R > 1) {
    tile_rows<R - 1>(rows, a, lda, K, w, bias, add, ldadd, out, ldo, cols);
  }
}

#if defined(__AVX512F__)
template <int R>
inline void tile2_rows(int rows, const float* a, int64_t lda, int64_t K, const float* w0, const float* w1,
                       const float* bias, const float* add, int64_t ldadd, float* out, int64_t ldo, int cols1) {
  if (rows == R) {
    tile2<R>(a, lda, K, w0, w1, bias, add, ldadd, out, ldo, cols1);
  } else if constexpr (R > 1) {
    tile2_rows<R - 1>(rows, a, lda, K, w0, w1, bias, add, ldadd, out, ldo, cols1);
  }
}
#endif

// out[M, N] (row stride ldo) = a[M, K] (row stride lda) times the packed weight's transpose, plus bias[N]
// when given, then plus add[M, N] (row stride ldadd; it may be `out` itself) when given. Orphaned work
// sharing (call it inside a parallel region, or from one thread) over tasks of up to kMC rows times one
// column block, or two neighbouring ones where the ISA has the registers; a thread's tasks share rows, so
// their slice of `a` stays in cache while the weight panels stream.
void gemm_packed(const float* a, int64_t lda, int64_t M, int64_t K, const float* packed, int64_t N,
                 const float* bias, const float* add, int64_t ldadd, float* out, int64_t ldo) {
  constexpr int64_t kMC = 96;
  const int64_t blocks = (N + kNB - 1) / kNB;
  // Pairs of blocks pay from a few row tiles on; a decode batch reads each weight panel in fewer passes alone.
  const int64_t span = kPairs && M >= 3 * kMR ? 2 : 1;
  const int64_t groups = (blocks + span - 1) / span, chunks = (M + kMC - 1) / kMC;
#pragma omp for schedule(static)
  for (int64_t task = 0; task < chunks * groups; ++task) {
    const int64_t nb = (task % groups) * span, n0 = nb * kNB;
    const int64_t m_begin = (task / groups) * kMC, m_end = std::min(M, m_begin + kMC);
    const float* b = bias ? bias + n0 : nullptr;
#if defined(__AVX512F__)
    if (span == 2 && nb + 1 < blocks) {
      const int cols1 = static_cast<int>(std::min<int64_t>(kNB, N - n0 - kNB));
      for (int64_t m0 = m_begin; m0 < m_end; m0 += kMR2) {
        const int rows = static_cast<int>(std::min<int64_t>(kMR2, m_end - m0));
        tile2_rows<kMR2>(rows, a + m0 * lda, lda, K, packed + nb * K * kNB, packed + (nb + 1) * K * kNB, b,
                         add ? add + m0 * ldadd + n0 : nullptr, ldadd, out + m0 * ldo + n0, ldo, cols1);
      }
      continue;
    }
#endif
    const int cols = static_cast<int>(std::min<int64_t>(kNB, N - n0));
    for (int64_t m0 = m_begin; m0 < m_end; m0 += kMR) {
      const int rows = static_cast<int>(std::min<int64_t>(kMR, m_end - m0));
      tile_rows<kMR>(rows, a + m0 * lda, lda, K, packed + nb * K * kNB, b, add ? add + m0 * ldadd + n0 : nullptr,
                     ldadd, out + m0 * ldo + n0, ldo, cols);
    }
  }
}

struct LayerArgs {
  float* hidden;  // [T, H] in/out: the residual stream
  int64_t tokens, hidden_size, intermediate;
  const float *ln1, *ln2;
  float eps1, eps2;
  const float *w_qkv, *b_qkv, *w_o, *w_gate_up, *w_down;  // packed; b_qkv may be null
  const float *cos, *sin;  // [T, D]
  const int64_t* slot_mapping;
  float* scratch;
};

template <int kHeadDim>
int layer_impl(const LayerArgs& L, DecodeArgs d, int num_threads) {
  const int64_t T = L.tokens, H = L.hidden_size, I = L.intermediate;
  const int hq = d.num_q_heads, hkv = d.num_kv_heads, D = d.head_dim;
  const int64_t n_qkv = static_cast<int64_t>(hq + 2 * hkv) * D, n_q = static_cast<int64_t>(hq) * D;
  const int64_t num_slots = d.num_blocks * d.block_size;
  float* x = L.scratch;              // [T, H] normed
  float* qkv = x + T * H;            // [T, n_qkv]
  float* qk = qkv + T * n_qkv;       // [T, hq + hkv, D] after RoPE
  float* attn = qk + T * (n_q + static_cast<int64_t>(hkv) * D);  // [T, hq * D]
  float* gate_up = attn + T * n_q;   // [T, 2I]
  float* act = gate_up + T * 2 * I;  // [T, I]
  d.query = qk;
  d.q_sb = static_cast<int64_t>(hq + hkv) * D;
  d.q_sh = D;
  d.out = attn;
  int status = kOk;
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) rms_row_f32(L.hidden + t * H, L.ln1, x + t * H, H, L.eps1);
    gemm_packed(x, H, T, H, L.w_qkv, n_qkv, L.b_qkv, nullptr, 0, qkv, n_qkv);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const float* row = qkv + t * n_qkv;
      float* rotated = qk + t * d.q_sb;
      for (int h = 0; h < hq + hkv; ++h) rope_row_f32(row + h * D, L.cos + t * D, L.sin + t * D, rotated + h * D, D);
      const int64_t slot = L.slot_mapping[t];
      if (slot < 0) continue;
      if (slot >= num_slots) {
#pragma omp atomic write
        status = kBlockOutOfRange;
        continue;
      }
      const int64_t base = (slot / d.block_size) * d.c_sblock + (slot % d.block_size) * d.c_sslot;
      for (int h = 0; h < hkv; ++h) {
        std::memcpy(const_cast<char*>(d.k_cache) + (base + h * d.c_shead) * 4, rotated + (hq + h) * D, D * 4);
        std::memcpy(const_cast<char*>(d.v_cache) + (base + h * d.c_shead) * 4, row + n_q + (hkv + h) * D, D * 4);
      }
    }
    decode_tasks<0, kHeadDim>(d, num_threads, status);
    gemm_packed(attn, n_q, T, n_q, L.w_o, H, nullptr, L.hidden, H, L.hidden, H);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) rms_row_f32(L.hidden + t * H, L.ln2, x + t * H, H, L.eps2);
    gemm_packed(x, H, T, H, L.w_gate_up, 2 * I, nullptr, nullptr, 0, gate_up, 2 * I);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) silu_mul_row_f32(gate_up + t * 2 * I, gate_up + t * 2 * I + I, act + t * I, I);
    gemm_packed(act, I, T, I, L.w_down, H, nullptr, L.hidden, H, L.hidden, H);
  }
  return status;
}

}  // namespace

extern "C" {

// out[M, N] = a[M, K] @ W^T (+ bias) (+ add), W packed as above (torch reference: cpu_layer_ref.gemm_packed_ref).
// a, add and out row-major with the given row strides; bias [N] or null; add may be null or alias out.
int tgi_paged_gemm_packed(const float* a, int64_t lda, int64_t M, int64_t K, const float* packed, int64_t N,
                          const float* bias, const float* add, int64_t ldadd, float* out, int64_t ldo, int num_threads) {
#pragma omp parallel num_threads(num_threads)
  gemm_packed(a, lda, M, K, packed, N, bias, add, ldadd, out, ldo);
  return kOk;
}

// One decode step of a Llama-form decoder layer over T requests (one token each), fp32 throughout (torch
// reference: cpu_layer_ref.llama_decode_layer_ref):
//   h += o_proj(attention(rope(qkv_proj(rms_norm(h, ln1))))); h += down(silu(gate) * up)(rms_norm(h, ln2))
// hidden [T, H] contiguous, updated in place; w_qkv packed [(Hq + 2 Hkv) D, H] (q, k, v heads in order) with
// optional bias; w_o [H, Hq D]; w_gate_up [2I, H] (gate rows first); w_down [H, I]; cos/sin [T, D]; the
// new K (after RoPE) and V are written to their slots of fp32 pools [num_blocks, block_size, Hkv, D]
// (element strides c_sblock, c_sslot, c_shead; negative slots skipped) before request b attends over its
// seq_lens[b] positions (window > 0: the last `window`). scratch: T * (H + (2 Hq + 3 Hkv) D + Hq D + 3I)
// floats. Returns 0, or 3 for a slot or block id outside the pool, 2 for a table too narrow for a seq_len.
int tgi_paged_llama_decode_layer(
    float* hidden, int64_t tokens, int64_t hidden_size, int64_t intermediate,
    const float* ln1, float eps1, const float* ln2, float eps2,
    const float* w_qkv, const float* b_qkv, const float* w_o, const float* w_gate_up, const float* w_down,
    const float* cos, const float* sin,
    void* k_cache, void* v_cache, int64_t num_blocks, int64_t c_sblock, int64_t c_sslot, int64_t c_shead,
    const int64_t* slot_mapping, const void* block_tables, int bt_int64, int64_t bt_stride, int64_t bt_width,
    const void* seq_lens, int sl_int64,
    int num_q_heads, int num_kv_heads, int head_dim, int block_size, float scale, int window,
    float* scratch, int num_threads) {
  const LayerArgs L{hidden, tokens, hidden_size, intermediate, ln1, ln2, eps1, eps2, w_qkv, b_qkv, w_o,
                    w_gate_up, w_down, cos, sin, slot_mapping, scratch};
  const DecodeArgs d{nullptr, 0, 0, static_cast<const char*>(k_cache), static_cast<const char*>(v_cache), nullptr,
                     c_sblock, c_sslot, c_shead, num_blocks, block_tables, bt_int64, bt_stride, bt_width,
                     seq_lens, sl_int64, nullptr, static_cast<int>(tokens), num_q_heads, num_kv_heads, head_dim,
                     block_size, scale, 0.0f, window, nullptr, 1.0f, 1.0f};
  switch (head_dim) {
    case 64: return layer_impl<64>(L, d, num_threads);
    case 128: return layer_impl<128>(L, d, num_threads);
    default: return layer_impl<0>(L, d, num_threads);
  }
}

}  // extern "C"
