// Host side of the chunked forward: validates, lays out the workspace (chunk_plan.h), and
// queues chunk_prepare then chunk_state.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "core/error.h"
#include "ops/delta_rule/cuda/chunk_kernels.cuh"
#include "ops/delta_rule/cuda/chunk_plan.h"
#include "ops/delta_rule/cuda/delta_rule_cuda.h"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda {

using namespace kda::ops::cuda_detail;

namespace {

// ---- pipelined forward: chunk_prepare of piece p + 1 beside chunk_state of piece p ----
// chunk_state is a sequential walk; when its grid has at most one block per SM (one or two
// long sequences), each SM still has room for a chunk_prepare block (74 KB of shared memory
// beside <= 112 KB), so the sequences are cut into kPieces pieces of chunks: prepare runs one
// piece ahead on a low-priority stream, state follows piece by piece on a high-priority one,
// the state between pieces goes through a workspace buffer (`carry`). Fork and join through
// events keep the whole call ordered on the caller's stream.
constexpr int kPieces = 8, kMaxPieces = 16;

// Kernel-lab knob: KDA_PIPELINE_PIECES=n (2..16) cuts the sequences into n pieces instead of 8
// (timing only).
int pipeline_pieces() {
  if (const char* knob = std::getenv("KDA_PIPELINE_PIECES"))
    return std::clamp(std::atoi(knob), 2, kMaxPieces);
  return kPieces;
}

struct PipelineStreams {
  cudaStream_t prepare = nullptr, state = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr, piece[kMaxPieces] = {};
  std::mutex mutex;  // the streams and events are shared by the calls on this device
};

PipelineStreams& pipeline_streams() {
  static PipelineStreams per_device[64];
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  require(device >= 0 && device < 64, "delta rule (cuda chunk): device index out of range");
  PipelineStreams& p = per_device[device];
  std::lock_guard<std::mutex> lock(p.mutex);
  if (!p.prepare) {
    int least = 0, greatest = 0;
    check_cuda(cudaDeviceGetStreamPriorityRange(&least, &greatest), "stream priorities");
    check_cuda(cudaStreamCreateWithPriority(&p.prepare, cudaStreamNonBlocking, least),
               "pipeline stream");
    check_cuda(cudaStreamCreateWithPriority(&p.state, cudaStreamNonBlocking, greatest),
               "pipeline stream");
    for (cudaEvent_t* e : {&p.fork, &p.join})
      check_cuda(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "pipeline event");
    for (cudaEvent_t& e : p.piece)
      check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "pipeline event");
  }
  return p;
}

// The longest sequence's chunk count if the forward should be pipelined, else 0.
int64_t pipeline_chunks(const ChunkPlan& plan, const DeltaRuleShape& s) {
  // Kernel-lab knob: KDA_PIPELINE=0 turns it off, KDA_PIPELINE=2 pipelines whatever the state
  // grid (timing only: e.g. one-tile state blocks on batches with KDA_STATE_NT=1).
  const char* knob = std::getenv("KDA_PIPELINE");
  if (knob && knob[0] == '0') return 0;
  const bool forced = knob && knob[0] == '2';
  // only for one-tile state blocks (at most one per SM): beside two-tile blocks (2 x 8192
  // tokens: 128 blocks of 8 warps) the pipeline measured slower (1.036 against 0.925 ms). The
  // wgmma state walk (one warpgroup, 106 KB) leaves room for a prepare block beside each of
  // its blocks; pipelined when they fit in one wave (not yet measured against the plain order:
  // KDA_PIPELINE=0 times that). The split walk (chunk_state_split.cu, 161 KB) leaves no room:
  // at 1 x 65536 it measured 3.785 ms pipelined against 3.678 ms in order (2026-12-03).
  const bool room =
      chunk_state_uses_wgmma(plan.num_seqs, int(s.HV), int(s.K), int(s.V))
          ? chunk_state_wgmma_blocks(plan.num_seqs, int(s.HV), int(s.V)) <= device_sm_count()
          : !chunk_state_wide(plan.num_seqs, int(s.HV), int(s.V)) &&
                chunk_state_blocks(plan.num_seqs, int(s.HV), int(s.V)) <= device_sm_count() &&
                !chunk_state_split_on();
  if (!forced && !room) return 0;
  const int64_t* seq_nchunks = plan.tables.data() + 2 * plan.num_chunks + plan.num_seqs;
  const int64_t longest = *std::max_element(seq_nchunks, seq_nchunks + plan.num_seqs);
  return longest >= 4 * pipeline_pieces() ? longest : 0;  // pieces of >= 4 chunks
}

void pipelined_forward(const ChunkTokens& x, const ChunkWorkspace& ws, Gate gate, int64_t N, int K,
                       int V, int64_t longest, float* carry, cudaStream_t stream) {
  PipelineStreams& p = pipeline_streams();
  std::lock_guard<std::mutex> lock(p.mutex);
  check_cuda(cudaEventRecord(p.fork, stream), "pipeline fork");
  check_cuda(cudaStreamWaitEvent(p.prepare, p.fork, 0), "pipeline fork");
  check_cuda(cudaStreamWaitEvent(p.state, p.fork, 0), "pipeline fork");
  const int pieces = pipeline_pieces();
  const int64_t piece = (longest + pieces - 1) / pieces;
  for (int i = 0; i < pieces; ++i) {
    ChunkWorkspace wp = ws;
    wp.piece_begin = i * piece;
    wp.piece_end = (i + 1) * piece;
    launch_chunk_prepare(x, wp, gate, K, V, p.prepare);
    check_cuda(cudaEventRecord(p.piece[i], p.prepare), "pipeline piece");
    check_cuda(cudaStreamWaitEvent(p.state, p.piece[i], 0), "pipeline piece");
    ChunkTokens xp = x;
    xp.h0 = i == 0 ? x.h0 : carry;  // the carry is read and written in place, tile by tile
    xp.ht = i == pieces - 1 ? x.ht : carry;
    launch_chunk_state(xp, wp, N, K, V, p.state);
  }
  check_cuda(cudaEventRecord(p.join, p.state), "pipeline join");
  check_cuda(cudaStreamWaitEvent(stream, p.join, 0), "pipeline join");
}

}  // namespace

size_t chunk_forward_workspace_bytes(const DeltaRuleShape& shape,
                                     std::span<const int64_t> cu_seqlens) {
  shape.validate();
  return make_chunk_plan(shape, cu_seqlens, false).total_bytes;
}

void chunk_forward(const DeltaRuleDeviceInputs& in, void* o, float* ht, void* workspace,
                   size_t workspace_bytes, cudaStream_t stream) {
  const DeltaRuleShape& s = in.shape;
  s.validate();
  const KdaLayerParams layer = kda_layer_params(in, "delta rule (cuda chunk)");
  if (in.dtype == ElementType::f32) {
    require(workspace_bytes >= recurrent_forward_workspace_bytes(in.cu_seqlens),
            "delta rule (cuda chunk): workspace too small");
    return recurrent_forward(in, o, ht, workspace, workspace_bytes, stream);
  }
  require((s.K == 64 || s.K == 128) && (s.V == 64 || s.V == 128),
          "delta rule (cuda chunk): bf16 path supports K, V in {64, 128}, got K=" +
              std::to_string(s.K) + " V=" + std::to_string(s.V));
  require(in.q && in.k && in.v && in.beta && o,
          "delta rule (cuda chunk): q, k, v, beta and o must be non-null");
  require(s.gate == Gate::none || in.g, "delta rule (cuda chunk): the gate g is null");
  require(s.HV <= 65535, "delta rule (cuda chunk): HV too large");
  const ChunkPlan plan = make_chunk_plan(s, in.cu_seqlens, false);
  require(plan.num_seqs <= 65535, "delta rule (cuda chunk): at most 65535 sequences per call");
  require(workspace && workspace_bytes >= plan.total_bytes,
          "delta rule (cuda chunk): workspace too small (" + std::to_string(workspace_bytes) +
              " < " + std::to_string(plan.total_bytes) + " bytes)");

  const int64_t N = plan.num_seqs;
  ChunkWorkspace ws = bind_chunk_workspace(plan, workspace, stream);
  // Gated DeltaNet: chunk_state reads q, k and applies the scalar decays itself, where that
  // measured faster: with two-tile state blocks (prepare -10%, state about even); with
  // one-tile blocks (one long sequence) the state walk lost more (2.57 against 2.21 ms at
  // 1 x 65536) than prepare gained (0.15 ms)
  // (the wgmma walk takes the raw path on every grid: not yet measured without it)
  // (the split walk, chunk_state_split.cu, reads plain operands: raw measured slower there)
  ws.raw_qk = s.gate == Gate::scalar && (chunk_state_uses_wgmma(N, int(s.HV), int(s.K), int(s.V)) ||
                                         (chunk_state_wide(N, int(s.HV), int(s.V)) &&
                                          !chunk_state_split_wide(N, int(s.HV), int(s.V))));
  // Kernel-lab knob: KDA_GDN_RAW=0 keeps Qt / Kd in the workspace for Gated DeltaNet too.
  if (const char* raw = std::getenv("KDA_GDN_RAW")) ws.raw_qk = ws.raw_qk && raw[0] != '0';
  // On the wgmma walk the raw path also forms M there (prepare skips it). Kernel-lab knob:
  // KDA_GDN_STATE_M=0 keeps M in the workspace.
  const char* state_m = std::getenv("KDA_GDN_STATE_M");
  ws.m_in_state = ws.raw_qk && chunk_state_uses_wgmma(N, int(s.HV), int(s.K), int(s.V)) &&
                  !(state_m && state_m[0] == '0');
  // Kernel-lab knob (not yet measured): KDA_GDN_SPLIT_Q=1 lets the split walk's output warps read
  // Gated DeltaNet's q rows and scale P themselves (chunk_state_split.cu's QROWS), so
  // chunk_prepare does not write Qt.
  if (const char* split_q = std::getenv("KDA_GDN_SPLIT_Q");
      split_q && split_q[0] == '1' && s.gate == Gate::scalar && !ws.raw_qk &&
      !chunk_state_uses_wgmma(N, int(s.HV), int(s.K), int(s.V)) && chunk_state_split_on()) {
    const bool wide = chunk_state_wide(N, int(s.HV), int(s.V));
    ws.qt_in_state = !wide || chunk_state_split_wide(N, int(s.HV), int(s.V));
  }

  const ChunkTokens x = chunk_tokens(in, layer, o, ht);
  // Kernel-lab knob: KDA_CHUNK_STAGES=prepare|state runs one stage alone (for timing only;
  // the output is then incomplete). Unset in normal use.
  const char* stages = std::getenv("KDA_CHUNK_STAGES");
  const bool only_prepare = stages && std::strcmp(stages, "prepare") == 0;
  const bool only_state = stages && std::strcmp(stages, "state") == 0;
  const int K = int(s.K), V = int(s.V);
  if (const int64_t longest = stages ? 0 : pipeline_chunks(plan, s)) {
    float* carry = reinterpret_cast<float*>(static_cast<char*>(workspace) + plan.off_carry);
    return pipelined_forward(x, ws, s.gate, N, K, V, longest, carry, stream);
  }
  if (!only_state) launch_chunk_prepare(x, ws, s.gate, K, V, stream);
  if (!only_prepare) launch_chunk_state(x, ws, N, K, V, stream);
}

}  // namespace kda::ops::cuda
