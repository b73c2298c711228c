#include "train/cuda/device_params.h"

#include <cmath>

#include "core/error.h"
#include "ops/nn/cuda/nn_cuda.h"

namespace kda::train::cuda {

namespace k = ops::cuda;
using k::check_cuda;
using k::DeviceBuffer;
using k::ElementType;

DeviceParams::DeviceParams(std::vector<Param*> host, cudaStream_t stream) : stream_(stream) {
  for (Param* p : host) {
    auto e = std::make_unique<Entry>();
    e->host = p;
    e->n = p->value.numel();
    const size_t bytes = size_t(e->n) * 4;
    for (DeviceBuffer* b : {&e->value, &e->grad, &e->m, &e->v}) {
      b->resize(bytes);
      check_cuda(cudaMemsetAsync(b->data(), 0, bytes, stream_), "cudaMemsetAsync");
    }
    if (p->value.shape().size() >= 2) e->copy.resize(size_t(e->n) * 2);
    require(by_name_.emplace(p->name, e.get()).second,
            "device parameters: two parameters are named '" + p->name + "'");
    entries_.push_back(std::move(e));
  }
  push();
}

DeviceParams::Entry& DeviceParams::at(const std::string& name) {
  const auto it = by_name_.find(name);
  require(it != by_name_.end(), "device parameters: no parameter named '" + name + "'");
  return *it->second;
}

void DeviceParams::push() {
  check_cuda(cudaStreamSynchronize(stream_), "device parameters: push");
  for (auto& e : entries_) {
    e->value.upload(e->host->value.f32(), size_t(e->n) * 4);
    if (e->copy.data())
      k::convert(e->value.data(), ElementType::f32, e->copy.data(), ElementType::bf16, e->n,
                 stream_);
  }
  check_cuda(cudaStreamSynchronize(stream_), "device parameters: push");
}

void DeviceParams::pull() {
  check_cuda(cudaStreamSynchronize(stream_), "device parameters: pull");
  for (auto& e : entries_) e->value.download(e->host->value.f32(), size_t(e->n) * 4);
}

void DeviceParams::zero_grads() {
  for (auto& e : entries_)
    check_cuda(cudaMemsetAsync(e->grad.data(), 0, e->grad.bytes(), stream_), "cudaMemsetAsync");
}

void DeviceParams::reset_moments() {
  for (auto& e : entries_)
    for (DeviceBuffer* b : {&e->m, &e->v})
      check_cuda(cudaMemsetAsync(b->data(), 0, b->bytes(), stream_), "cudaMemsetAsync");
}

void DeviceParams::scale_grads(float s) {
  for (auto& e : entries_) k::scale(e->g(), e->n, s, stream_);
}

std::vector<float> DeviceParams::gradient(const std::string& name) {
  Entry& e = at(name);
  check_cuda(cudaStreamSynchronize(stream_), "device parameters: gradient");
  std::vector<float> g(static_cast<size_t>(e.n));
  e.grad.download(g.data(), g.size() * 4);
  return g;
}

double DeviceParams::adamw(const AdamWConfig& config, float lr, int64_t step) {
  if (!adamw_) {  // the tensors never move: one table for the model's life
    std::vector<k::AdamWTensor> tensors;
    for (auto& e : entries_)
      tensors.push_back({e->f(), e->g(), e->m.as<float>(), e->v.as<float>(), e->copy.data(), e->n,
                         e->host->decay});
    adamw_ = std::make_unique<k::AdamWMultiTensor>(tensors);
  }
  k::AdamWHyper hyper;
  hyper.lr = lr;
  hyper.beta1 = config.beta1;
  hyper.beta2 = config.beta2;
  hyper.eps = config.eps;
  hyper.weight_decay = config.weight_decay;
  adamw_->step(hyper, step, config.clip_norm, stream_);
  double norm = 0;  // (after the update is queued: the copy waits for it)
  check_cuda(cudaMemcpyAsync(&norm, adamw_->norm_device(), sizeof(double), cudaMemcpyDeviceToHost,
                             stream_),
             "cudaMemcpyAsync (gradient norm)");
  check_cuda(cudaStreamSynchronize(stream_), "device adamw");
  require(std::isfinite(norm), "adamw: the gradient is not finite");  // (nothing was updated)
  return norm;
}

std::vector<std::pair<std::string, Tensor>> DeviceParams::moments() const {
  check_cuda(cudaStreamSynchronize(stream_), "device parameters: moments");
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& e : entries_) {
    for (const auto& [prefix, buffer] :
         {std::pair{std::string("m."), &e->m}, std::pair{std::string("v."), &e->v}}) {
      Tensor t(DType::f32, e->host->value.shape());
      buffer->download(t.f32(), size_t(e->n) * 4);
      out.emplace_back(prefix + e->host->name, std::move(t));
    }
  }
  return out;
}

void DeviceParams::load_moments(const std::vector<std::pair<std::string, Tensor>>& tensors) {
  std::map<std::string, const Tensor*> by_name;
  for (const auto& [name, t] : tensors) by_name[name] = &t;
  check_cuda(cudaStreamSynchronize(stream_), "device parameters: load moments");
  for (auto& e : entries_) {
    for (const auto& [prefix, buffer] :
         {std::pair{std::string("m."), &e->m}, std::pair{std::string("v."), &e->v}}) {
      const auto it = by_name.find(prefix + e->host->name);
      require(it != by_name.end(), "optimizer state lacks '" + prefix + e->host->name + "'");
      require(it->second->shape() == e->host->value.shape(),
              "optimizer state '" + prefix + e->host->name + "' has the wrong shape");
      buffer->upload(it->second->f32(), size_t(e->n) * 4);
    }
  }
}

double DeviceAdamW::step() {
  const float lr = lr_at(step_);
  const double norm = params_.adamw(config_, lr, step_ + 1);
  ++step_;
  return norm;
}

void DeviceAdamW::load_state(const std::vector<std::pair<std::string, Tensor>>& tensors,
                             int64_t step) {
  params_.load_moments(tensors);
  step_ = step;
}

}  // namespace kda::train::cuda
