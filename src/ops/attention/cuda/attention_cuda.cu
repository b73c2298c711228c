// Validation, path choice and split planning of the CUDA attention op (see attention_cuda.h);
// the kernels live in attention_{generic,prefill,decode}.cu.
#include "ops/attention/cuda/attention_cuda.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <string_view>

#include "core/error.h"
#include "ops/attention/cuda/attention_kernels.cuh"
#include "ops/common/device_attributes.h"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda_detail {

bool attention_wgmma_enabled() {
  static const bool disabled = [] {
    const char* env = std::getenv("KDA_ATTENTION_WGMMA");
    return env != nullptr && std::string_view(env) == "0";
  }();
  return !disabled && device_cc_major() == 9;
}

bool attention_wide_rows(int64_t Tq, int Hq, int batch) {
  static const int forced = [] {
    const char* rows = std::getenv("KDA_ATTENTION_ROWS");
    return rows ? std::atoi(rows) : 0;
  }();
  if (forced == 16 || forced == 32) return forced == 32;
  const int64_t blocks = (Tq + 127) / 128 * int64_t(Hq) * batch;
  return Tq >= 128 && blocks >= 3 * int64_t(device_sm_count());
}

dim3 attention_tile_grid(int64_t tiles, int heads, int batch) {
  static const bool heads_first = [] {
    const char* order = std::getenv("KDA_ATTENTION_ORDER");
    return order != nullptr && std::string_view(order) == "heads";
  }();
  const int64_t blocks = tiles * heads * batch;
  if (heads_first || blocks > int64_t(0x7fffffff))
    return dim3(unsigned(tiles), unsigned(heads), unsigned(batch));
  return dim3(unsigned(blocks));
}

}  // namespace kda::ops::cuda_detail

namespace kda::ops::cuda {

namespace {

using namespace kda::ops::cuda_detail;

// Up to this many queries run the split-sequence decode path (either dtype); longer query
// blocks run the prefill kernel (bf16) or the plain fp32 kernel.
constexpr int64_t kDecodeMaxTq = 15;
// Query rows (head in group x query) one decode block serves (attention_decode.cu's RB = 2).
constexpr int64_t kDecodeRowsPerBlock = 32;

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Throws kda::Error with message() when ok is false; the message is only built on failure (this
// runs on every decode step, where a dozen string allocations are a visible cost).
template <class Message>
void check(bool ok, const Message& message) {
  if (!ok) throw kda::Error(message());
}

void validate_sizes(const AttentionArgs& a) {
  check(a.dtype == ElementType::f32 || a.dtype == ElementType::bf16,
        [&] { return std::string("attention_forward: dtype must be f32 or bf16"); });
  check(a.Tq >= 1, [&] {
    return std::string("attention_forward: Tq must be >= 1 (got " + std::to_string(a.Tq) + ")");
  });
  check(a.Tk >= 1, [&] {
    return std::string("attention_forward: Tk must be >= 1 (got " + std::to_string(a.Tk) + ")");
  });
  check(a.Hq >= 1 && a.Hq <= 65535,
        [&] { return std::string("attention_forward: Hq must be in [1, 65535]"); });
  check(a.Hkv >= 1 && a.Hkv <= 65535,
        [&] { return std::string("attention_forward: Hkv must be in [1, 65535]"); });
  check(a.Hq % a.Hkv == 0, [&] {
    return std::string("attention_forward: Hq (" + std::to_string(a.Hq) +
                       ") must be a multiple of Hkv (" + std::to_string(a.Hkv) + ")");
  });
  check(a.Dk >= 1 && a.Dk <= kAttentionMaxDk, [&] {
    return std::string("attention_forward: Dk must be in [1, 576] (got " + std::to_string(a.Dk) +
                       ")");
  });
  check(a.Dv >= 1 && a.Dv <= kAttentionMaxDv, [&] {
    return std::string("attention_forward: Dv must be in [1, 512] (got " + std::to_string(a.Dv) +
                       ")");
  });
  if (a.Tk_device == nullptr) {
    check(a.q_offset >= 0, [&] { return std::string("attention_forward: q_offset must be >= 0"); });
    check(a.q_offset + a.Tq <= a.Tk, [&] {
      return std::string("attention_forward: Tk (" + std::to_string(a.Tk) +
                         ") must be >= q_offset + Tq (" + std::to_string(a.q_offset + a.Tq) + ")");
    });
  } else {  // q_offset is ignored (n - Tq); Tk bounds n
    check(a.lse == nullptr,
          [&] { return std::string("attention_forward: lse is not supported with Tk_device"); });
    check(a.Tq <= kDecodeMaxTq, [&] {
      return std::string("attention_forward: Tk_device supports decode only (Tq <= " +
                         std::to_string(kDecodeMaxTq) + ", got " + std::to_string(a.Tq) + ")");
    });
    check(a.Tq <= a.Tk, [&] {
      return std::string("attention_forward: Tk (" + std::to_string(a.Tk) + ") must be >= Tq (" +
                         std::to_string(a.Tq) + ")");
    });
  }
  check(a.Tk < (int64_t(1) << 31), [&] { return std::string("attention_forward: Tk too large"); });
  check(a.Tq * a.Hq < (int64_t(1) << 31),
        [&] { return std::string("attention_forward: Tq * Hq too large"); });
  check(std::isfinite(a.scale),
        [&] { return std::string("attention_forward: scale must be finite"); });
  check(a.q_row_stride == 0 || a.q_row_stride >= a.Hq * a.Dk,
        [&] { return std::string("attention_forward: q_row_stride must be 0 or >= Hq * Dk"); });
  check(a.k_row_stride == 0 || a.k_row_stride >= a.Hkv * a.Dk,
        [&] { return std::string("attention_forward: k_row_stride must be 0 or >= Hkv * Dk"); });
  check(a.v_row_stride == 0 || a.v_row_stride >= a.Hkv * a.Dv,
        [&] { return std::string("attention_forward: v_row_stride must be 0 or >= Hkv * Dv"); });
  check(a.batch >= 1 && a.batch <= 65535, [&] {
    return std::string("attention_forward: batch must be in [1, 65535] (got " +
                       std::to_string(a.batch) + ")");
  });
  if (a.batch > 1) {
    check(a.Tk_device == nullptr, [&] {
      return std::string("attention_forward: Tk_device (decode) supports batch == 1 only");
    });
    check(a.q_batch_stride >= 0 && a.k_batch_stride >= 0 && a.v_batch_stride >= 0,
          [&] { return std::string("attention_forward: q/k/v_batch_stride must be >= 0"); });
    check(a.o_batch_stride == 0 || a.o_batch_stride >= a.Tq * a.Hq * a.Dv, [&] {
      return std::string("attention_forward: o_batch_stride must be 0 or >= Tq * Hq * Dv");
    });
    check(a.lse_batch_stride == 0 || a.lse_batch_stride >= a.Tq * a.Hq, [&] {
      return std::string("attention_forward: lse_batch_stride must be 0 or >= Tq * Hq");
    });
  }
}

struct Plan {
  bool decode = false;
  int nsplit = 0;
  int64_t split_len = 0;
};

// Decode, bf16 sizes the bulk-copy kernel takes: as many blocks as the GPU holds at once (splits
// x KV heads x row groups), every split a whole number (>= 2 where the cache allows: a split's
// partials cost about one tile) of its 32-key tiles. Otherwise about one block per SM, splits of
// 64-key tiles. At most kAttentionMaxSplits splits.
Plan make_plan(const AttentionArgs& a) {
  Plan plan;
  // The split decode path does not produce lse: a caller that wants it gets the direct path.
  plan.decode = a.Tq <= kDecodeMaxTq && a.lse == nullptr;
  if (!plan.decode) return plan;
  check(a.batch == 1, [&] {
    return std::string(
        "attention_forward: the split decode path (Tq <= " + std::to_string(kDecodeMaxTq) +
        " without lse) supports batch == 1 only (got batch " + std::to_string(a.batch) +
        "; set lse for the direct path)");
  });
  // Keys any query sees; with a device count, its bound Tk (the plan must not depend on n).
  const int64_t kv_len = a.Tk_device != nullptr ? a.Tk : a.q_offset + a.Tq;
  const int64_t group = a.Hq / a.Hkv;
  const int64_t blocks_per_split = a.Hkv * ceil_div(group * a.Tq, kDecodeRowsPerBlock);
  const int64_t k_stride = a.k_row_stride ? a.k_row_stride : a.Hkv * a.Dk;
  const int64_t v_stride = a.v_row_stride ? a.v_row_stride : a.Hkv * a.Dv;
  const bool v_alias =
      a.v != nullptr && a.v == a.k && v_stride == k_stride && a.Hkv == 1 && a.Dv <= a.Dk;
  const int bulk_blocks = a.dtype == ElementType::bf16 ? attention_decode_bulk_blocks_per_sm(
                                                             a.Dk, a.Dv, group * a.Tq, v_alias)
                                                       : 0;
  const int64_t tile = bulk_blocks > 0 ? kAttentionBulkKeyTile : kAttentionKeyTile;
  const int64_t tiles = ceil_div(kv_len, tile);
  const int64_t max_splits = bulk_blocks > 0 ? std::max<int64_t>(1, tiles / 2) : tiles;
  int64_t want = ceil_div(int64_t(device_sm_count()) * std::max(1, bulk_blocks), blocks_per_split);
  want = std::clamp<int64_t>(want, 1, std::min<int64_t>(max_splits, kAttentionMaxSplits));
  plan.split_len = ceil_div(tiles, want) * tile;
  plan.nsplit = int(ceil_div(kv_len, plan.split_len));
  return plan;
}

size_t partial_floats(const AttentionArgs& a, const Plan& plan) {
  return size_t(plan.nsplit) * size_t(a.Tq * a.Hq) * size_t(a.Dv + 2);
}

}  // namespace

size_t attention_workspace_bytes(const AttentionArgs& args) {
  validate_sizes(args);
  const Plan plan = make_plan(args);
  if (!plan.decode) return 0;
  return partial_floats(args, plan) * sizeof(float);
}

void attention_forward(const AttentionArgs& args, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream) {
  validate_sizes(args);
  check(args.q != nullptr && args.k != nullptr && args.v != nullptr &&
            (args.o != nullptr) != (args.o_bf16 != nullptr),
        [] {
          return std::string(
              "attention_forward: q, k, v and one of o / o_bf16 must be device pointers");
        });
  const Plan plan = make_plan(args);
  check(args.o_bf16 == nullptr || !plan.decode, [] {
    return std::string("attention_forward: o_bf16 needs a direct path (Tq >= 16 or lse set)");
  });

  AttentionParams p;
  p.q = args.q;
  p.k = args.k;
  p.v = args.v;
  p.o = args.o;
  p.o_bf16 = args.o_bf16;
  p.lse = args.lse;
  p.q_stride = args.q_row_stride ? args.q_row_stride : args.Hq * args.Dk;
  p.k_stride = args.k_row_stride ? args.k_row_stride : args.Hkv * args.Dk;
  p.v_stride = args.v_row_stride ? args.v_row_stride : args.Hkv * args.Dv;
  p.q_bstride = args.q_batch_stride ? args.q_batch_stride : args.Tq * p.q_stride;
  p.k_bstride = args.k_batch_stride ? args.k_batch_stride : args.Tk * p.k_stride;
  p.v_bstride = args.v_batch_stride ? args.v_batch_stride : args.Tk * p.v_stride;
  p.o_bstride = args.o_batch_stride ? args.o_batch_stride : args.Tq * args.Hq * args.Dv;
  p.lse_bstride = args.lse_batch_stride ? args.lse_batch_stride : args.Tq * args.Hq;
  p.batch = int(args.batch);
  p.Tq = args.Tq;
  p.Tk = args.Tk;
  p.q_offset = args.Tk_device != nullptr ? 0 : args.q_offset;
  p.kv_len_device = args.Tk_device;
  p.Hq = int(args.Hq);
  p.Hkv = int(args.Hkv);
  p.group = int(args.Hq / args.Hkv);
  p.Dk = int(args.Dk);
  p.Dv = int(args.Dv);
  p.scale = args.scale != 0.f ? args.scale : float(1.0 / std::sqrt(double(args.Dk)));
  const bool bf16 = args.dtype == ElementType::bf16;

  if (plan.decode) {
    const size_t floats = partial_floats(args, plan);
    check(workspace != nullptr && workspace_bytes >= floats * sizeof(float), [&] {
      return "attention_forward: workspace too small (need " +
             std::to_string(floats * sizeof(float)) + " bytes, got " +
             std::to_string(workspace_bytes) + "; see attention_workspace_bytes)";
    });
    const size_t rows = size_t(args.Tq * args.Hq);
    p.part_acc = static_cast<float*>(workspace);
    p.part_m = p.part_acc + size_t(plan.nsplit) * rows * size_t(args.Dv);
    p.part_l = p.part_m + size_t(plan.nsplit) * rows;
    p.nsplit = plan.nsplit;
    p.split_len = plan.split_len;
    const bool launched =
        bf16 && (launch_attention_decode_bulk(p, stream) || launch_attention_decode(p, stream));
    if (!launched) launch_attention_generic(p, bf16, stream);
    launch_attention_combine(p, stream);
    return;
  }
  if (bf16 && launch_attention_prefill(p, stream)) return;
  launch_attention_generic(p, bf16, stream);
}

}  // namespace kda::ops::cuda
