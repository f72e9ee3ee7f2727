// Normalisation layers, as torch.nn: LayerNorm, BatchNorm1d/2d, RMSNorm,
// GroupNorm. Composites of kiln ops (so autograd differentiates them);
// affine weights start at ones and biases at zeros, as PyTorch's.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kiln/nn/module.h"

namespace kiln::nn {

struct LayerNormOptions {
  std::vector<int64_t> normalized_shape = {};  // the trailing dims normalised over
  double eps = 1e-5;
  bool elementwise_affine = true;
  std::optional<DType> dtype = std::nullopt;
};
/// (x - mean) / sqrt(biased var + eps) over the last dims, then * weight + bias.
class LayerNorm : public Module {
 public:
  explicit LayerNorm(LayerNormOptions o);
  Tensor forward(const Tensor& x) override;
  /// (*this)(x), for a caller whose only use of the output is as the input of
  /// a lower-precision product under autocast (a transformer's norm before its
  /// linear). Under bf16 autocast, with a float32 x, affine parameters and no
  /// hooks, the output comes back in bf16: the bits the product's own cast
  /// would make of it, in one pass instead of two, and likewise for the
  /// gradient (ops::layer_norm_to). Otherwise it is (*this)(x).
  Tensor forward_for_product(const Tensor& x);
  std::string extra_repr() const override;
  const LayerNormOptions options;
  Tensor& weight;  // undefined without elementwise_affine
  Tensor& bias;
};

struct BatchNormOptions {
  int64_t num_features = 0;
  double eps = 1e-5;
  /// Unset: a cumulative average (factor 1 / num_batches_tracked), as torch's momentum=None.
  std::optional<double> momentum = 0.1;
  bool affine = true;
  bool track_running_stats = true;
  std::optional<DType> dtype = std::nullopt;
};
/// Normalises each channel (dim 1) over the batch and spatial dims. Training
/// uses batch statistics and updates running_mean / running_var (unbiased)
/// with `momentum` and counts num_batches_tracked; eval uses the running ones.
class BatchNorm : public Module {
 public:
  Tensor forward(const Tensor& x) override;
  /// relu(forward(x)), the same values and gradients, with the ReLU inside
  /// batch norm's own passes in training on a channels-last input (a conv's
  /// output): the zoo's conv -> BN -> ReLU. With a forward hook on this
  /// module it runs (*this)(x).relu(), so the hook sees the module's output.
  Tensor forward_relu(const Tensor& x);
  /// relu(forward(x) + residual), a residual block's end, fused the same way
  /// when x and residual are channels-last (hooks: as forward_relu).
  Tensor forward_add_relu(const Tensor& x, const Tensor& residual);
  std::string extra_repr() const override;
  const BatchNormOptions options;
  Tensor& weight;
  Tensor& bias;
  Tensor& running_mean;  // undefined without track_running_stats
  Tensor& running_var;
  Tensor& num_batches_tracked;

 protected:
  BatchNorm(std::string type_name, BatchNormOptions o, int64_t min_dim, int64_t max_dim);

 private:
  Tensor forward_impl(const Tensor& x, bool relu, const Tensor& residual);
  int64_t min_dim_, max_dim_;
};
/// Input [N, C] or [N, C, L].
class BatchNorm1d : public BatchNorm {
 public:
  explicit BatchNorm1d(BatchNormOptions o) : BatchNorm("BatchNorm1d", o, 2, 3) {}
};
/// Input [N, C, H, W].
class BatchNorm2d : public BatchNorm {
 public:
  explicit BatchNorm2d(BatchNormOptions o) : BatchNorm("BatchNorm2d", o, 4, 4) {}
};

struct RMSNormOptions {
  std::vector<int64_t> normalized_shape = {};
  std::optional<double> eps = std::nullopt;  // unset: the dtype's machine epsilon, as torch
  bool elementwise_affine = true;
  std::optional<DType> dtype = std::nullopt;
};
/// x / sqrt(mean(x^2 over the last dims) + eps) * weight, as torch.nn.RMSNorm.
class RMSNorm : public Module {
 public:
  explicit RMSNorm(RMSNormOptions o);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  const RMSNormOptions options;
  Tensor& weight;
};

struct GroupNormOptions {
  int64_t num_groups = 1;
  int64_t num_channels = 0;
  double eps = 1e-5;
  bool affine = true;
  std::optional<DType> dtype = std::nullopt;
};
/// Input [N, C, *]: normalises each of num_groups channel groups per sample, then per-channel affine.
class GroupNorm : public Module {
 public:
  explicit GroupNorm(GroupNormOptions o);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
  const GroupNormOptions options;
  Tensor& weight;
  Tensor& bias;
};

}  // namespace kiln::nn
