// models::ResNet: a CIFAR-style residual network of torchvision BasicBlocks,
// the "resnet" workload of bench/WORKLOADS.md by default: conv3×3(3,16) + BN
// + ReLU; stages of 16, 32 (stride 2) and 64 (stride 2) channels with one
// BasicBlock each (a 1×1 conv + BN shortcut where the shape changes); global
// average pool; Linear(64, num_classes).
//
// state_dict names are torchvision's: conv1, bn1, layer1.0.conv1,
// layer1.0.bn1, …, layer2.0.downsample.0 (the 1×1 conv), layer2.0.downsample.1
// (its BN), fc. The PyTorch twin is in tests/parity/models_twins.py
// (torchvision.models.resnet.BasicBlock written out, with a 3×3 stride-1 stem
// and no max pool, as is usual for 32×32 inputs). Convolutions have no bias.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kiln/nn/checkpoint.h"
#include "kiln/nn/layers.h"
#include "kiln/nn/norm.h"

namespace kiln::models {

struct BasicBlockOptions {
  int64_t in_channels = 0;
  int64_t out_channels = 0;
  int64_t stride = 1;
};

/// relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)); shortcut is
/// downsample (Sequential(conv1x1, BatchNorm2d)) when stride != 1 or the
/// channel count changes, the identity otherwise.
class BasicBlock : public nn::Module {
 public:
  explicit BasicBlock(BasicBlockOptions o);
  Tensor forward(const Tensor& x) override;
  /// forward(x) as three checkpointed segments, "<name>.conv1" (conv1, bn1,
  /// ReLU), "<name>.downsample" and "<name>.conv2" (conv2, bn2, the add, ReLU),
  /// for a block whose shortcut is downsample; the values are forward's.
  Tensor forward_split_checkpointed(const Tensor& x, const std::string& name);
  const BasicBlockOptions options;
  std::shared_ptr<nn::Conv2d> conv1, conv2;
  std::shared_ptr<nn::BatchNorm2d> bn1, bn2;
  std::shared_ptr<nn::Sequential> downsample;  // null when the shortcut is the identity
};

struct ResNetOptions {
  int64_t in_channels = 3;
  int64_t stem_channels = 16;
  std::vector<int64_t> widths = {16, 32, 64};  // one stage each; stage i > 0 has stride 2
  std::vector<int64_t> blocks = {1, 1, 1};     // BasicBlocks per stage (same length as widths)
  int64_t num_classes = 10;
  /// Which BasicBlocks (counted across the stages) run under nn::checkpoint
  /// (copied into ResNet::checkpointing). Any policy but none also checkpoints
  /// the stem; blocks() splits a block with a downsample shortcut into three
  /// segments (BasicBlock::forward_split_checkpointed). BatchNorm's running
  /// statistics are updated once per step, not again when a segment is
  /// recomputed. What each choice saves: docs/memory.md.
  nn::CheckpointPolicy activation_checkpointing;
};

/// Input [N, in_channels, H, W]; output [N, num_classes].
class ResNet : public nn::Module {
 public:
  explicit ResNet(ResNetOptions o = {});
  Tensor forward(const Tensor& x) override;
  const ResNetOptions options;
  std::shared_ptr<nn::Conv2d> conv1;
  std::shared_ptr<nn::BatchNorm2d> bn1;
  std::vector<std::shared_ptr<nn::Sequential>> stages;  // "layer1", "layer2", …
  std::shared_ptr<nn::Linear> fc;
  /// Activation checkpointing of the stem and BasicBlocks; may be changed between steps.
  nn::CheckpointPolicy checkpointing = options.activation_checkpointing;
};

}  // namespace kiln::models
