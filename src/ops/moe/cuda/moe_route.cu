// Sigmoid routing on the device, one warp per token, with the CPU op's exact order of choice
// (ops/moe/cpu/moe_routing.cpp): a candidate beats another when its value is larger, or equal
// with the lower index, so repeated warp arg-max picks the same experts as std::partial_sort.
#include <cuda_runtime.h>

#include <cmath>
#include <limits>
#include <string>

#include "core/error.h"
#include "ops/moe/cuda/moe_common.cuh"
#include "ops/moe/cuda/moe_cuda.h"

namespace kda::ops::cuda {
namespace {

using moe_detail::check_launch;

struct RouteParams {
  int E, top_k, num_groups, topk_groups;
  bool renormalize;
  double scaling;
};

// The best candidate among v[0, n) not yet taken, by (larger value, then lower index); every
// lane returns the same index (-1 when all are taken).
__device__ int warp_best(const float* v, const int* taken, int n, int lane) {
  float best = 0.f;
  int best_index = -1;
  for (int i = lane; i < n; i += 32) {  // indices rise, so ">" keeps the lowest among equals
    if (taken[i]) continue;
    if (best_index < 0 || v[i] > best) {
      best = v[i];
      best_index = i;
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other = __shfl_xor_sync(0xffffffffu, best, offset);
    const int other_index = __shfl_xor_sync(0xffffffffu, best_index, offset);
    const bool better = other_index >= 0 && (best_index < 0 || other > best ||
                                             (other == best && other_index < best_index));
    if (better) {
      best = other;
      best_index = other_index;
    }
  }
  return best_index;
}

// Block = one warp = one token. Shared: score[E], choice[E], group_score[G] (floats), then
// taken[E], group_taken[G] (ints).
__global__ void route_sigmoid_kernel(RouteParams p, const float* __restrict__ logits, int64_t T,
                                     const float* __restrict__ bias, int32_t* __restrict__ ids,
                                     float* __restrict__ weights) {
  extern __shared__ float shared[];
  const int E = p.E, G = p.num_groups;
  float* score = shared;
  float* choice = score + E;
  float* group_score = choice + E;
  int* taken = reinterpret_cast<int*>(group_score + G);
  int* group_taken = taken + E;
  const int64_t t = blockIdx.x;
  const int lane = threadIdx.x;
  const float* lt = logits + t * E;
  constexpr float kExcluded = -INFINITY;

  for (int e = lane; e < E; e += 32) {
    const float s = 1.0f / (1.0f + expf(-lt[e]));
    score[e] = s;
    choice[e] = s + (bias ? bias[e] : 0.0f);
    taken[e] = 0;
  }
  __syncwarp();
  if (G > 1) {
    const int per_group = E / G;
    for (int g = lane; g < G; g += 32) {  // the CPU's scan, verbatim
      const float* c = choice + g * per_group;
      float best = kExcluded, second = kExcluded;
      for (int i = 0; i < per_group; ++i) {
        if (c[i] > best) {
          second = best;
          best = c[i];
        } else if (c[i] > second) {
          second = c[i];
        }
      }
      group_score[g] = best + second;
      group_taken[g] = 0;
    }
    __syncwarp();
    for (int k = 0; k < p.topk_groups; ++k) {
      const int g = warp_best(group_score, group_taken, G, lane);
      if (lane == 0 && g >= 0) group_taken[g] = 1;
      __syncwarp();
    }
    for (int e = lane; e < E; e += 32)
      if (!group_taken[e / per_group]) choice[e] = kExcluded;
    __syncwarp();
  }
  int32_t* ids_t = ids + t * p.top_k;
  for (int j = 0; j < p.top_k; ++j) {
    const int e = warp_best(choice, taken, E, lane);
    if (lane == 0) {
      ids_t[j] = e;
      taken[e] = 1;
    }
    __syncwarp();
  }
  if (lane == 0) {  // the CPU's arithmetic: a double sum, then float(score * norm)
    double sum = 0;
    for (int j = 0; j < p.top_k; ++j) sum += score[ids_t[j]];
    const double norm = p.renormalize ? p.scaling / (sum + 1e-20) : p.scaling;
    for (int j = 0; j < p.top_k; ++j)
      weights[t * p.top_k + j] = float(double(score[ids_t[j]]) * norm);
  }
}

}  // namespace

void moe_route(const MoeRouting& routing, const float* logits, int64_t T, const float* bias,
               int32_t* ids, float* weights, cudaStream_t stream) {
  routing.validate();
  require(T >= 0, "moe_route: T must not be negative");
  if (T == 0) return;
  require(logits && ids && weights, "moe_route: null device pointer");
  require(T <= int64_t(std::numeric_limits<int32_t>::max()), "moe_route: too many tokens");
  const int64_t E = routing.num_experts, G = routing.num_groups;
  const size_t shared_bytes = size_t(2 * E + G) * sizeof(float) + size_t(E + G) * sizeof(int);
  require(shared_bytes <= 48 * 1024,
          "moe_route: num_experts " + std::to_string(E) + " is too large for the routing kernel");
  const RouteParams p{
      int(E),         int(routing.top_k), int(G), int(routing.topk_groups), routing.renormalize,
      routing.scaling};
  route_sigmoid_kernel<<<unsigned(T), 32, shared_bytes, stream>>>(p, logits, T, bias, ids, weights);
  check_launch("moe_route");
}

}  // namespace kda::ops::cuda
