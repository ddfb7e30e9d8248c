// The server-side optimizers of the C++ engine: one step of TAGPS_SERVER_OPTIMIZER on a key's weights with
// the fused kernels (csrc/kernels), exactly as tagps/ps/optimizer.py's ServerOptimizer calls them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "net/buffer.h"

namespace tagps::net {

// ServerOptimizerConfig's fields (tagps/config.py); name "none" means plain summation.
struct OptimizerConfig {
  std::string name = "none";  // none | sgd | adam | adamw | rmsprop
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;
  double alpha = 0.99;
  bool centered = false;
  bool amsgrad = false;
  bool maximize = false;
};

// Per-key mutable state: the step count and the buffers named by buffer_names(), in that order.
struct OptimizerState {
  int64_t step = 0;
  std::vector<SharedBuffer> buffers;
};

class ServerOptimizer {
 public:
  // Throws InvalidArgument for an unknown name or "none".
  explicit ServerOptimizer(OptimizerConfig config);

  const OptimizerConfig& config() const { return config_; }
  // Names of the per-key state buffers (ServerOptimizer.buffer_names in Python), each of the weights'
  // dtype and size.
  const std::vector<std::string>& buffer_names() const { return names_; }
  // Zeroed state for `nbytes` of weights.
  OptimizerState new_state(size_t nbytes) const;
  // param -= one step on grad (count elements of float32 or float64), state.step counted first.
  void step(DType dtype, void* param, const void* grad, size_t count, OptimizerState& state) const;

 private:
  template <typename T>
  void step_typed(T* param, const T* grad, size_t count, OptimizerState& state) const;

  OptimizerConfig config_;
  std::vector<std::string> names_;
};

}  // namespace tagps::net
