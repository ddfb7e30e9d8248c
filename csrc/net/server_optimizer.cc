#include "net/server_optimizer.h"

#include <utility>

#include "common/error.h"
#include "kernels/adam.h"
#include "kernels/rmsprop.h"
#include "kernels/sgd.h"

namespace tagps::net {

ServerOptimizer::ServerOptimizer(OptimizerConfig config) : config_(std::move(config)) {
  const std::string& n = config_.name;
  if (n == "adam" || n == "adamw") {
    names_ = {"exp_avg", "exp_avg_sq"};
    if (config_.amsgrad) names_.push_back("max_exp_avg_sq");
  } else if (n == "sgd") {
    if (config_.momentum != 0.0) names_.push_back("momentum_buffer");
  } else if (n == "rmsprop") {
    names_ = {"square_avg"};
    if (config_.momentum != 0.0) names_.push_back("momentum_buffer");
    if (config_.centered) names_.push_back("grad_avg");
  } else {
    throw InvalidArgument("ServerOptimizer needs TAGPS_SERVER_OPTIMIZER=sgd|adam|adamw|rmsprop, got " + n);
  }
}

OptimizerState ServerOptimizer::new_state(size_t nbytes) const {
  OptimizerState state;
  for (size_t i = 0; i < names_.size(); ++i) state.buffers.push_back(std::make_shared<AlignedBuffer>(nbytes));
  return state;
}

void ServerOptimizer::step(DType dtype, void* param, const void* grad, size_t count,
                           OptimizerState& state) const {
  if (dtype == DType::kFloat32) {
    step_typed(static_cast<float*>(param), static_cast<const float*>(grad), count, state);
  } else if (dtype == DType::kFloat64) {
    step_typed(static_cast<double*>(param), static_cast<const double*>(grad), count, state);
  } else {
    throw InvalidType(std::string("the optimizer steps take float32 or float64, got ") + dtype_name(dtype));
  }
}

template <typename T>
void ServerOptimizer::step_typed(T* param, const T* grad, size_t count, OptimizerState& state) const {
  TAGPS_ENFORCE_EQ(state.buffers.size(), names_.size(), "optimizer state buffers");
  const auto buffer = [&](const char* name) -> T* {
    for (size_t i = 0; i < names_.size(); ++i) {
      if (names_[i] == name) return static_cast<T*>(state.buffers[i]->data());
    }
    return nullptr;
  };
  const OptimizerConfig& c = config_;
  state.step += 1;
  if (c.name == "adam" || c.name == "adamw") {
    kernels::AdamOptions<T> o;
    o.param = param;
    o.grad = grad;
    o.exp_avg = buffer("exp_avg");
    o.exp_avg_sq = buffer("exp_avg_sq");
    o.max_exp_avg_sq = buffer("max_exp_avg_sq");
    o.count = count;
    o.step = state.step;
    o.lr = c.lr;
    o.beta1 = c.beta1;
    o.beta2 = c.beta2;
    o.eps = c.eps;
    o.weight_decay = c.weight_decay;
    o.amsgrad = c.amsgrad;
    o.maximize = c.maximize;
    o.decoupled_weight_decay = c.name == "adamw";
    kernels::adam_step(o);
  } else if (c.name == "sgd") {
    kernels::SgdOptions<T> o;
    o.param = param;
    o.grad = grad;
    o.momentum_buffer = buffer("momentum_buffer");
    o.count = count;
    o.lr = c.lr;
    o.momentum = c.momentum;
    o.dampening = c.dampening;
    o.weight_decay = c.weight_decay;
    o.nesterov = c.nesterov;
    o.maximize = c.maximize;
    o.first_step = state.step == 1;
    kernels::sgd_step(o);
  } else {
    kernels::RmspropOptions<T> o;
    o.param = param;
    o.grad = grad;
    o.square_avg = buffer("square_avg");
    o.momentum_buffer = buffer("momentum_buffer");
    o.grad_avg = buffer("grad_avg");
    o.count = count;
    o.lr = c.lr;
    o.alpha = c.alpha;
    o.eps = c.eps;
    o.weight_decay = c.weight_decay;
    o.momentum = c.momentum;
    o.centered = c.centered;
    o.maximize = c.maximize;
    kernels::rmsprop_step(o);
  }
}

}  // namespace tagps::net
