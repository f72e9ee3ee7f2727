// quant: folding an eval-mode BatchNorm into the convolution before it, as
// torch.ao.quantization.fuse_modules does for Conv2d + BatchNorm2d:
//
//   s = gamma / sqrt(running_var + eps)       (per output channel)
//   w' = w · s,   b' = (b - running_mean) · s + beta
//
// computed in float64 and stored in float32, so quantization sees one layer
// (one weight scale per channel that already includes BN's) and inference
// skips BN's pass. Covers the Conv2d -> BatchNorm2d pairs kiln's models call
// through typed members: models::ResNet's stem, each models::BasicBlock's
// conv1/bn1, conv2/bn2 and its downsample Sequential (1x1 conv, BN).
// models::CNN has no BatchNorm. The folded BatchNorm is replaced by a
// FoldedBatchNorm2d (no parameters or buffers; it passes its input through,
// so the ReLU and residual add the parent runs through it are unchanged).
#pragma once

#include <string>
#include <vector>

#include "kiln/nn/module.h"
#include "kiln/nn/norm.h"

namespace kiln::quant {

/// A BatchNorm2d already folded into the convolution before it: the identity.
class FoldedBatchNorm2d : public nn::BatchNorm2d {
 public:
  explicit FoldedBatchNorm2d(int64_t num_features);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;
};

/// Folds every covered Conv2d + BatchNorm2d pair of `model` (see the header
/// comment). The BatchNorms must be in eval mode with running statistics
/// (ValueError naming the module otherwise, before anything changes). Returns
/// the folded BatchNorms' paths, in model order.
std::vector<std::string> fuse_conv_bn(nn::Module& model);

}  // namespace kiln::quant
