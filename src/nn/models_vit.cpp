// models::ViT: patch embedding by a strided Conv2d, class token, learned
// positions, pre-LN encoder blocks (nn::TransformerBlock, non-causal), final
// LayerNorm and a linear head on the class token. Names and registration
// order follow the twin in tests/parity/models_twins_gpt.py.
#include "kiln/models/vit.h"

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/nn/init.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/index.h"

namespace kiln::models {
namespace {
const ViTOptions& checked(const ViTOptions& o) {
  KILN_CHECK(o.image_size > 0 && o.patch_size > 0 && o.image_size % o.patch_size == 0, ValueError,
             "ViT: expected patch_size > 0 dividing image_size > 0, got patch_size ", o.patch_size, " and image_size ",
             o.image_size);
  KILN_CHECK(o.in_channels > 0 && o.num_classes > 0 && o.depth > 0 && o.mlp_dim > 0, ValueError,
             "ViT: expected in_channels, num_classes, depth and mlp_dim > 0, got ", o.in_channels, ", ", o.num_classes,
             ", ", o.depth, " and ", o.mlp_dim);
  KILN_CHECK(o.dim > 0 && o.heads > 0 && o.dim % o.heads == 0, ValueError,
             "ViT: expected dim > 0 divisible by heads > 0, got dim ", o.dim, " and heads ", o.heads);
  return o;
}
}  // namespace

ViT::ViT(ViTOptions o)
    : nn::Module("ViT"),
      options(checked(o)),
      cls_token(register_parameter("cls_token", zeros({1, 1, o.dim}))),
      pos_embed(register_parameter("pos_embed", zeros({1, num_patches() + 1, o.dim}))) {
  {
    NoGradGuard g;
    nn::init::trunc_normal_(cls_token, 0.0, 0.02, -0.04, 0.04);
    nn::init::trunc_normal_(pos_embed, 0.0, 0.02, -0.04, 0.04);
  }
  patch_embed =
      register_module("patch_embed", std::make_shared<nn::Conv2d>(nn::Conv2dOptions{.in_channels = o.in_channels,
                                                                                    .out_channels = o.dim,
                                                                                    .kernel_size = {o.patch_size},
                                                                                    .stride = {o.patch_size}}));
  blocks = register_module("blocks", std::make_shared<nn::ModuleList>());
  for (int64_t i = 0; i < o.depth; ++i)
    blocks->push_back(std::make_shared<nn::TransformerBlock>(nn::TransformerBlockOptions{
        .d_model = o.dim, .n_head = o.heads, .d_ff = o.mlp_dim, .dropout = o.dropout, .causal = false}));
  norm = register_module("norm", std::make_shared<nn::LayerNorm>(nn::LayerNormOptions{.normalized_shape = {o.dim}}));
  head = register_module(
      "head", std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = o.dim, .out_features = o.num_classes}));
}

int64_t ViT::num_patches() const {
  const int64_t g = options.image_size / options.patch_size;
  return g * g;
}

Tensor ViT::forward(const Tensor& x) {
  KILN_CHECK(x.dim() == 4 && x.size(1) == options.in_channels && x.size(2) == options.image_size &&
                 x.size(3) == options.image_size,
             ShapeError, "ViT: expected input [N, ", options.in_channels, ", ", options.image_size, ", ",
             options.image_size, "], got shape ", x.shape_string());
  const int64_t N = x.size(0);
  Tensor p = (*patch_embed)(x).flatten(2).transpose(1, 2);  // [N, num_patches, dim]
  Tensor t = cat({cls_token.expand({N, 1, options.dim}), p}, 1) + pos_embed;
  t = nn::run_blocks(
      checkpointing, static_cast<int64_t>(blocks->size()),
      [this](int64_t i, const Tensor& u) { return (*(*blocks)[static_cast<size_t>(i)])(u); }, t, "blocks");
  return (*head)((*norm)(t).select(1, 0));
}

}  // namespace kiln::models
