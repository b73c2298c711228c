// Validation and path choice of the CUDA attention backward (see attention_cuda.h); the kernels
// live in attention_backward_{generic,mma}.cu.
#include <atomic>
#include <cmath>
#include <string>

#include "core/error.h"
#include "ops/attention/cuda/attention_backward_kernels.cuh"
#include "ops/attention/cuda/attention_cuda.h"
#include "ops/attention/cuda/attention_kernels.cuh"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda {

namespace {

using namespace kda::ops::cuda_detail;

void check(bool ok, const std::string& message) {
  if (!ok) throw kda::Error("attention_backward: " + message);
}

std::string str(int64_t x) {
  return std::to_string(x);
}

void validate_sizes(const AttentionArgs& a) {
  check(a.dtype == ElementType::f32 || a.dtype == ElementType::bf16, "dtype must be f32 or bf16");
  check(a.Tk_device == nullptr, "Tk_device is not supported (decode only)");
  check(a.Tq >= 1, "Tq must be >= 1 (got " + str(a.Tq) + ")");
  check(a.Tk >= 1, "Tk must be >= 1 (got " + str(a.Tk) + ")");
  check(a.Hq >= 1 && a.Hq <= 65535, "Hq must be in [1, 65535]");
  check(a.Hkv >= 1 && a.Hkv <= 65535, "Hkv must be in [1, 65535]");
  check(a.Hq % a.Hkv == 0, "Hq (" + str(a.Hq) + ") must be a multiple of Hkv (" + str(a.Hkv) + ")");
  check(a.Dk >= 1 && a.Dk <= kAttentionMaxDk,
        "Dk must be in [1, " + str(kAttentionMaxDk) + "] (got " + str(a.Dk) + ")");
  check(a.Dv >= 1 && a.Dv <= kAttentionMaxDv,
        "Dv must be in [1, " + str(kAttentionMaxDv) + "] (got " + str(a.Dv) + ")");
  check(a.q_offset >= 0, "q_offset must be >= 0");
  check(a.q_offset + a.Tq <= a.Tk,
        "Tk (" + str(a.Tk) + ") must be >= q_offset + Tq (" + str(a.q_offset + a.Tq) + ")");
  check(a.Tk < (int64_t(1) << 31) && a.Tq < (int64_t(1) << 31), "Tq or Tk too large");
  check(a.Tq * a.Hq < (int64_t(1) << 31) && a.Tk * a.Hkv < (int64_t(1) << 31),
        "Tq * Hq or Tk * Hkv too large");
  check(std::isfinite(a.scale), "scale must be finite");
  check(a.q_row_stride == 0 || a.q_row_stride >= a.Hq * a.Dk,
        "q_row_stride must be 0 or >= Hq * Dk");
  check(a.k_row_stride == 0 || a.k_row_stride >= a.Hkv * a.Dk,
        "k_row_stride must be 0 or >= Hkv * Dk");
  check(a.v_row_stride == 0 || a.v_row_stride >= a.Hkv * a.Dv,
        "v_row_stride must be 0 or >= Hkv * Dv");
  check(a.batch >= 1 && a.batch <= 65535, "batch must be in [1, 65535] (got " + str(a.batch) + ")");
  check(a.q_batch_stride >= 0 && a.k_batch_stride >= 0 && a.v_batch_stride >= 0 &&
            a.o_batch_stride >= 0 && a.lse_batch_stride >= 0,
        "batch strides must be >= 0");
  check(a.batch == 1 || a.o_batch_stride == 0 || a.o_batch_stride >= a.Tq * a.Hq * a.Dv,
        "o_batch_stride must be 0 or >= Tq * Hq * Dv");
  check(a.batch == 1 || a.lse_batch_stride == 0 || a.lse_batch_stride >= a.Tq * a.Hq,
        "lse_batch_stride must be 0 or >= Tq * Hq");
}

int64_t padded_rows(const AttentionArgs& a) {
  return (a.Tq + kAttentionBwdRowPad - 1) / kAttentionBwdRowPad * kAttentionBwdRowPad;
}

std::atomic<bool> deterministic_backward{false};

// Shapes the wgmma backward takes (its dQ is summed in fp32 in the workspace).
bool dq_accumulated(const AttentionArgs& a) {
  return a.dtype == ElementType::bf16 && a.Dk == 128 && a.Dv == 128 &&
         !deterministic_backward.load(std::memory_order_relaxed);
}

size_t workspace_floats(const AttentionArgs& a) {
  const size_t rows = 2 * size_t(a.batch) * size_t(a.Hq) * size_t(padded_rows(a));
  const size_t dq_sums = size_t(a.batch) * size_t(a.Tq) * size_t(a.Hq) * size_t(a.Dk);
  return rows + (dq_accumulated(a) ? dq_sums : 0);
}

}  // namespace

size_t attention_backward_workspace_bytes(const AttentionArgs& args) {
  validate_sizes(args);
  return workspace_floats(args) * sizeof(float);
}

void set_attention_backward_deterministic(bool on) {
  deterministic_backward.store(on, std::memory_order_relaxed);
}

bool attention_backward_dq_deterministic(const AttentionArgs& args) {
  return !(dq_accumulated(args) && cuda_detail::attention_wgmma_enabled());
}

void attention_backward(const AttentionArgs& args, const float* lse, const void* d_o, void* dq,
                        void* dk, void* dv, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream, const AttentionGradLayout& layout) {
  validate_sizes(args);
  check(layout.dq_row_stride == 0 || layout.dq_row_stride >= args.Hq * args.Dk,
        "layout.dq_row_stride must be 0 or >= Hq * Dk");
  check(layout.dk_row_stride == 0 || layout.dk_row_stride >= args.Hkv * args.Dk,
        "layout.dk_row_stride must be 0 or >= Hkv * Dk");
  check(layout.dv_row_stride == 0 || layout.dv_row_stride >= args.Hkv * args.Dv,
        "layout.dv_row_stride must be 0 or >= Hkv * Dv");
  check(args.q != nullptr && args.k != nullptr && args.v != nullptr &&
            (args.o != nullptr) != (args.o_bf16 != nullptr),
        "args.q, k, v and one of o / o_bf16 (the forward's output) must be device pointers");
  check(lse != nullptr && d_o != nullptr, "lse and d_o must be device pointers (got null)");
  check(dq != nullptr && dk != nullptr && dv != nullptr,
        "dq, dk and dv must be device pointers (got null)");
  const size_t need = workspace_floats(args) * sizeof(float);
  check(workspace != nullptr && workspace_bytes >= need,
        "workspace too small (need " + std::to_string(need) + " bytes, got " +
            std::to_string(workspace_bytes) + "; see attention_backward_workspace_bytes)");

  AttentionBwdParams p;
  p.q = args.q;
  p.k = args.k;
  p.v = args.v;
  p.o = args.o;
  p.o_bf16 = args.o_bf16;
  p.lse = lse;
  p.d_o = d_o;
  p.dq = dq;
  p.dk = dk;
  p.dv = dv;
  p.Tq_pad = padded_rows(args);
  p.lse2 = static_cast<float*>(workspace);
  p.delta = p.lse2 + size_t(args.batch) * size_t(args.Hq) * size_t(p.Tq_pad);
  if (dq_accumulated(args))
    p.dq_accum = p.delta + size_t(args.batch) * size_t(args.Hq) * size_t(p.Tq_pad);
  p.q_stride = args.q_row_stride ? args.q_row_stride : args.Hq * args.Dk;
  p.k_stride = args.k_row_stride ? args.k_row_stride : args.Hkv * args.Dk;
  p.v_stride = args.v_row_stride ? args.v_row_stride : args.Hkv * args.Dv;
  p.dq_stride = layout.dq_row_stride ? layout.dq_row_stride : args.Hq * args.Dk;
  p.dk_stride = layout.dk_row_stride ? layout.dk_row_stride : args.Hkv * args.Dk;
  p.dv_stride = layout.dv_row_stride ? layout.dv_row_stride : args.Hkv * args.Dv;
  p.q_bstride = args.q_batch_stride ? args.q_batch_stride : args.Tq * p.q_stride;
  p.k_bstride = args.k_batch_stride ? args.k_batch_stride : args.Tk * p.k_stride;
  p.v_bstride = args.v_batch_stride ? args.v_batch_stride : args.Tk * p.v_stride;
  p.o_bstride = args.o_batch_stride ? args.o_batch_stride : args.Tq * args.Hq * args.Dv;
  p.lse_bstride = args.lse_batch_stride ? args.lse_batch_stride : args.Tq * args.Hq;
  p.batch = int(args.batch);
  p.Tq = args.Tq;
  p.Tk = args.Tk;
  p.q_offset = args.q_offset;
  p.Hq = int(args.Hq);
  p.Hkv = int(args.Hkv);
  p.group = int(args.Hq / args.Hkv);
  p.Dk = int(args.Dk);
  p.Dv = int(args.Dv);
  p.scale = args.scale != 0.f ? args.scale : float(1.0 / std::sqrt(double(args.Dk)));
  const bool bf16 = args.dtype == ElementType::bf16;

  launch_attention_bwd_preprocess(p, bf16, stream);
  if (bf16 && launch_attention_bwd_mma(p, stream)) return;
  launch_attention_bwd_generic(p, bf16, stream);
}

}  // namespace kda::ops::cuda
