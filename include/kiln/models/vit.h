// models::ViT: a small Vision Transformer classifier (Dosovitskiy et al.):
// patch embedding, class token, learned positions, pre-LayerNorm encoder
// blocks, final LayerNorm, and a linear head on the class token. The default
// is the MNIST-sized configuration (28×28×1 images, 7×7 patches, dim 64,
// depth 2, 4 heads, MLP 128).
//
// state_dict names (the PyTorch twin in tests/parity/models_twins_gpt.py has the same):
//   cls_token     [1, 1, dim]              class token (N(0, 0.02) truncated at ±2σ)
//   pos_embed     [1, num_patches + 1, dim] learned positions (N(0, 0.02) truncated at ±2σ)
//   patch_embed   Conv2d(in_channels, dim, kernel = stride = patch_size)
//   blocks.N      nn::TransformerBlock with causal = false: ln_1, attn.c_attn,
//                 attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj (GELU(tanh) in the MLP)
//   norm          LayerNorm(dim)
//   head          Linear(dim, num_classes)
// Linear, Conv2d and LayerNorm keep torch's default initialisation.
#pragma once

#include <cstdint>
#include <memory>

#include "kiln/nn/checkpoint.h"
#include "kiln/nn/layers.h"
#include "kiln/nn/norm.h"
#include "kiln/nn/transformer.h"

namespace kiln::models {

struct ViTOptions {
  int64_t image_size = 28;  // square images
  int64_t patch_size = 7;   // must divide image_size
  int64_t in_channels = 1;
  int64_t num_classes = 10;
  int64_t dim = 64;
  int64_t depth = 2;
  int64_t heads = 4;
  int64_t mlp_dim = 128;
  double dropout = 0.0;  // inside the blocks (attention weights, after each projection)
  /// Which encoder blocks run under nn::checkpoint (copied into ViT::checkpointing).
  nn::CheckpointPolicy activation_checkpointing;
};

/// Input [N, in_channels, image_size, image_size]; output [N, num_classes].
class ViT : public nn::Module {
 public:
  explicit ViT(ViTOptions o = {});
  Tensor forward(const Tensor& x) override;
  const ViTOptions options;
  int64_t num_patches() const;
  Tensor& cls_token;
  Tensor& pos_embed;
  std::shared_ptr<nn::Conv2d> patch_embed;
  std::shared_ptr<nn::ModuleList> blocks;  // of nn::TransformerBlock (causal = false)
  std::shared_ptr<nn::LayerNorm> norm;
  std::shared_ptr<nn::Linear> head;
  /// Activation checkpointing of the blocks (nn::CheckpointPolicy); may be changed between steps.
  nn::CheckpointPolicy checkpointing = options.activation_checkpointing;
};

}  // namespace kiln::models
