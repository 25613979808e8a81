// The MoE MLP of a decode step (cpu_layer.cpp): router GEMM, softmax and top-k per token, then each hit expert's
// gated MLP over the rows routed to it (gathered, two packed GEMMs), weighted and summed per token in expert
// order, as transformers' MixtralExperts / Qwen3MoeExperts sum them. Torch reference:
// tgi_paged_kernels.cpu_layer_ref.decode_layer_ref.
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

// Softmax over one token's `experts` router logits, its top_k (largest first; ties: lower index first, as
// torch.topk on CPU), renormalized over the top_k when `normalize`: appended to `picks` as (expert, weight).
inline void route_token(const float* logits, int experts, int top_k, bool normalize, std::vector<float>& probs,
                        std::vector<std::pair<int, float>>& picks) {
  float top = logits[0];
  for (int e = 1; e < experts; ++e) top = std::max(top, logits[e]);
  float total = 0.0f;
  for (int e = 0; e < experts; ++e) total += (probs[e] = std::exp(logits[e] - top));
  for (int e = 0; e < experts; ++e) probs[e] = probs[e] / total;
  picks.clear();
  float picked = 0.0f;
  for (int k = 0; k < top_k; ++k) {
    int best = -1;
    for (int e = 0; e < experts; ++e)
      if (probs[e] >= 0.0f && (best < 0 || probs[e] > probs[best])) best = e;
    picks.emplace_back(best, probs[best]);
    picked += probs[best];
    probs[best] = -1.0f;  // taken
  }
  if (normalize)
    for (auto& pick : picks) pick.second = pick.second / picked;
}

// out[T, H] = sum over each token's top_k experts e of w_e * down_e(act(gate_e(x)) * up_e(x)) for x = mlp_x[t].
// Called by every thread of the layer's parallel region (work-shared inside). Weights packed in weight_dtype
// (gemm_weights): w_router [E, H]; expert e's gate/up [2I, H] and down [H, I] one after another in w_gate_up, w_down.
// scratch: T * (E + 2H) floats; gate_up [T, 2I] and act [T, I] are the layer's. activate(gu, act, rows) applies
// the layer's activation to `rows` rows of gate_up.
template <class Activate>
void moe_mlp(const float* mlp_x, int64_t T, int64_t H, int64_t I, int experts, int top_k, bool normalize,
             int weight_dtype, const void* w_router, const void* w_gate_up, const void* w_down, float* scratch,
             float* gate_up, float* act, float* out, MoeRouting& routing, Activate activate) {
  const int64_t gu_stride = packed_bytes(weight_dtype, 2 * I, H), down_stride = packed_bytes(weight_dtype, H, I);
  const char *gu_base = static_cast<const char*>(w_gate_up), *down_base = static_cast<const char*>(w_down);
  float* logits = scratch;              // [T, E]
  float* rows = logits + T * experts;   // [T, H] the rows routed to one expert
  float* expert_out = rows + T * H;     // [T, H] that expert's output for them
  gemm_weights(weight_dtype, mlp_x, H, T, H, w_router, experts, nullptr, nullptr, 0, logits, experts);
#pragma omp single
  {
    std::vector<float> probs(experts);
    std::vector<std::pair<int, float>> picks;
    std::vector<std::vector<std::pair<int64_t, float>>> by_expert(experts);
    for (int64_t t = 0; t < T; ++t) {
      route_token(logits + t * experts, experts, top_k, normalize, probs, picks);
      for (const auto& [e, w] : picks) by_expert[e].emplace_back(t, w);
    }
    routing.start.assign(1, 0);
    routing.token.clear();
    routing.weight.clear();
    for (const auto& taken : by_expert) {
      for (const auto& [t, w] : taken) {
        routing.token.push_back(t);
        routing.weight.push_back(w);
      }
      routing.start.push_back(static_cast<int64_t>(routing.token.size()));
    }
  }  // implicit barrier: every thread sees the routing
#pragma omp for schedule(static)
  for (int64_t i = 0; i < T * H; ++i) out[i] = 0.0f;
  for (int e = 0; e < experts; ++e) {
    const int64_t first = routing.start[e], n = routing.start[e + 1] - first;
    if (n == 0) continue;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r)
      std::copy(mlp_x + routing.token[first + r] * H, mlp_x + (routing.token[first + r] + 1) * H, rows + r * H);
    gemm_weights(weight_dtype, rows, H, n, H, gu_base + e * gu_stride, 2 * I, nullptr, nullptr, 0, gate_up, 2 * I);
    activate(gate_up, act, n);
    gemm_weights(weight_dtype, act, I, n, I, down_base + e * down_stride, H, nullptr, nullptr, 0, expert_out, H);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r) {  // one expert takes a token once: no two rows add to the same output
      float* o = out + routing.token[first + r] * H;
      const float* y = expert_out + r * H;
      const float w = routing.weight[first + r];
      for (int64_t i = 0; i < H; ++i) o[i] = o[i] + y[i] * w;
    }
  }
}

}  // namespace
