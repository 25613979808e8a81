// The MoE MLP of a decode step (cpu_layer.cpp): router GEMM, softmax and top-k per token, then each hit expert's
// gated MLP over the rows routed to it (gathered, two packed GEMMs), weighted and summed per token in expert
// order, as transformers' MixtralExperts / Qwen3MoeExperts sum them; run_experts alone serves the experts of the
// other steps (cpu_gemm.cpp's tgi_paged_moe_experts, given transformers' routing). Torch references:
// tgi_paged_kernels.cpu_layer_ref.decode_layer_ref, cpu_layer_ref.moe_experts_ref.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_gemm_bf16.h"

namespace {

// Which rows each expert takes: tokens of expert e are token[start[e] .. start[e + 1]), with their weights.
struct MoeRouting {
  std::vector<int64_t> start, token;
  std::vector<float> weight;
};

// Softmax over one token's `experts` router logits, its top_k (largest first; ties: lower index first, and NaN above
// every number, as torch.topk on CPU), renormalized over the top_k when `normalize`: appended to `picks` as
// (expert, weight). A NaN logit so gives NaN weights and a NaN output, as transformers' block gives, never a read
// outside the experts.
inline void route_token(const float* logits, int experts, int top_k, bool normalize, std::vector<float>& probs,
                        std::vector<std::pair<int, float>>& picks) {
  float top = logits[0];
  for (int e = 1; e < experts; ++e) top = std::max(top, logits[e]);
  float total = 0.0f;
  for (int e = 0; e < experts; ++e) total += (probs[e] = std::exp(logits[e] - top));
  for (int e = 0; e < experts; ++e) probs[e] = probs[e] / total;
  picks.clear();
  float picked = 0.0f;
  constexpr float kTaken = -1.0f;  // below every probability
  for (int k = 0; k < top_k; ++k) {
    int best = -1;
    for (int e = 0; e < experts; ++e) {
      const float p = probs[e];
      if (p == kTaken) continue;
      if (best < 0 || (std::isnan(p) && !std::isnan(probs[best])) || p > probs[best]) best = e;
    }
    picks.emplace_back(best, probs[best]);
    picked += probs[best];
    probs[best] = kTaken;
  }
  if (normalize)
    for (auto& pick : picks) pick.second = pick.second / picked;
}

// Groups each token's top_k (expert, weight) picks (index, weight: [T, top_k]) by expert, tokens in order, as
// torch.where(top_k_index == e) lists them. A pick of `experts` is no expert (transformers' experts skip it: expert
// parallelism marks picks held elsewhere so). False (routing unset) for a pick outside [0, experts] or an expert
// picked twice by a token (two rows of one expert would then add to the same output).
inline bool group_by_expert(int64_t T, int top_k, int experts, const int64_t* index, const float* weight,
                            MoeRouting& routing) {
  std::vector<int64_t> count(experts + 2, 0);  // the last: the skipped picks
  for (int64_t i = 0; i < T * top_k; ++i) {
    if (index[i] < 0 || index[i] > experts) return false;
    ++count[index[i] + 1];
  }
  for (int e = 0; e <= experts; ++e) count[e + 1] += count[e];
  routing.start.assign(count.begin(), count.end() - 1);  // experts + 1 starts: the skipped picks come last
  routing.token.assign(T * top_k, 0);
  routing.weight.assign(T * top_k, 0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int k = 0; k < top_k; ++k) {
      const int64_t e = index[t * top_k + k], at = count[e]++;
      if (e < experts && at > routing.start[e] && routing.token[at - 1] == t) return false;
      routing.token[at] = t;
      routing.weight[at] = weight[t * top_k + k];
    }
  return true;
}

// out[T, H] = sum over the routed experts e of w * down_e(act(gate_e(x)) * up_e(x)) for x = mlp_x[t], added in
// expert order. Called by every thread of a parallel region (work-shared inside). Expert e's gate/up [2I, H] and
// down [H, I] packed in weight_dtype (gemm_weights), one after another in w_gate_up, w_down. rows, expert_out:
// [T, H] scratch each; gate_up [T, 2I], act [T, I]. activate(gu, act, rows) applies the activation to `rows` rows.
template <class Activate>
void run_experts(const float* mlp_x, int64_t T, int64_t H, int64_t I, int weight_dtype, const void* w_gate_up,
                 const void* w_down, const MoeRouting& routing, float* rows, float* expert_out, float* gate_up,
                 float* act, float* out, Activate activate) {
  const int64_t gu_stride = packed_bytes(weight_dtype, 2 * I, H), down_stride = packed_bytes(weight_dtype, H, I);
  const char *gu_base = static_cast<const char*>(w_gate_up), *down_base = static_cast<const char*>(w_down);
  // Barriers: the gather's (every row in place before the GEMM reads them) and the GEMMs' and the activation's own.
  // The zeroing and each scatter need none: a thread reaches the next scatter only through the next gather's
  // barrier, which every thread reaches only after its own scatter (expert_out is rewritten only after it); one
  // barrier at the end.
#pragma omp for schedule(static) nowait
  for (int64_t i = 0; i < T * H; ++i) out[i] = 0.0f;
  for (size_t e = 0; e + 1 < routing.start.size(); ++e) {
    const int64_t first = routing.start[e], n = routing.start[e + 1] - first;
    if (n == 0) continue;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r)
      std::copy(mlp_x + routing.token[first + r] * H, mlp_x + (routing.token[first + r] + 1) * H, rows + r * H);
    gemm_weights(weight_dtype, rows, H, n, H, gu_base + e * gu_stride, 2 * I, nullptr, nullptr, 0, gate_up, 2 * I);
    activate(gate_up, act, n);
    gemm_weights(weight_dtype, act, I, n, I, down_base + e * down_stride, H, nullptr, nullptr, 0, expert_out, H);
#pragma omp for schedule(static) nowait
    for (int64_t r = 0; r < n; ++r) {  // one expert takes a token once: no two rows add to the same output
      float* o = out + routing.token[first + r] * H;
      const float* y = expert_out + r * H;
      const float w = routing.weight[first + r];
      for (int64_t i = 0; i < H; ++i) o[i] = o[i] + y[i] * w;
    }
  }
#pragma omp barrier
}

// The MoE MLP of the decode step: the router's logits (w_router [E, H], packed), each token's top_k, then
// run_experts. scratch: T * (E + 2H) floats; gate_up [T, 2I] and act [T, I] are the layer's.
template <class Activate>
void moe_mlp(const float* mlp_x, int64_t T, int64_t H, int64_t I, int experts, int top_k, bool normalize,
             int weight_dtype, const void* w_router, const void* w_gate_up, const void* w_down, float* scratch,
             float* gate_up, float* act, float* out, MoeRouting& routing, Activate activate) {
  float* logits = scratch;              // [T, E]
  float* rows = logits + T * experts;   // [T, H] the rows routed to one expert
  float* expert_out = rows + T * H;     // [T, H] that expert's output for them
  gemm_weights(weight_dtype, mlp_x, H, T, H, w_router, experts, nullptr, nullptr, 0, logits, experts);
#pragma omp single
  {
    std::vector<float> probs(experts), weight(T * top_k);
    std::vector<int64_t> index(T * top_k);
    std::vector<std::pair<int, float>> picks;
    for (int64_t t = 0; t < T; ++t) {
      route_token(logits + t * experts, experts, top_k, normalize, probs, picks);
      for (int k = 0; k < top_k; ++k) {
        index[t * top_k + k] = picks[k].first;
        weight[t * top_k + k] = picks[k].second;
      }
    }
    group_by_expert(T, top_k, experts, index.data(), weight.data(), routing);  // picks in range, each once
  }  // implicit barrier: every thread sees the routing
  run_experts(mlp_x, T, H, I, weight_dtype, w_gate_up, w_down, routing, rows, expert_out, gate_up, act, out, activate);
}

}  // namespace
