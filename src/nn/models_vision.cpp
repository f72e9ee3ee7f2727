// The model zoo's image and vector classifiers: models::MLP, models::CNN,
// models::ResNet (with models::BasicBlock). Layer names and registration
// order follow the PyTorch twins in tests/parity/models_twins.py, so
// state_dict() keys match theirs exactly, in order.
#include <string>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/models/cnn.h"
#include "kiln/models/mlp.h"
#include "kiln/models/resnet.h"
#include "kiln/ops/conv.h"

namespace kiln::models {

namespace {
std::vector<int64_t> hw(const std::vector<int64_t>& v) {
  KILN_CHECK(v.size() == 1 || v.size() == 2, ValueError, "CNN: input_size expects 1 or 2 values, got ", v.size());
  return v.size() == 1 ? std::vector<int64_t>{v[0], v[0]} : v;
}
}  // namespace

// ---- MLP ----
MLP::MLP(MLPOptions o) : nn::Module("MLP"), options(std::move(o)) {
  KILN_CHECK(options.in_features > 0 && options.out_features > 0, ValueError,
             "MLP: in_features and out_features must be > 0, got ", options.in_features, " and ", options.out_features);
  layers = register_module("layers", std::make_shared<nn::Sequential>());
  int64_t d = options.in_features;
  for (int64_t h : options.hidden) {
    KILN_CHECK(h > 0, ValueError, "MLP: hidden sizes must be > 0, got ", h);
    layers->push_back(
        std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = d, .out_features = h, .bias = options.bias}));
    layers->push_back(std::make_shared<nn::ReLU>());
    d = h;
  }
  layers->push_back(std::make_shared<nn::Linear>(
      nn::LinearOptions{.in_features = d, .out_features = options.out_features, .bias = options.bias}));
}

Tensor MLP::forward(const Tensor& x) {
  KILN_CHECK(x.dim() >= 2, ShapeError, "MLP: expected input [N, ...] with at least 2 dims, got shape ",
             x.shape_string());
  Tensor flat = x.dim() == 2 ? x : x.flatten(1);
  KILN_CHECK(flat.size(1) == options.in_features, ShapeError, "MLP: expected ", options.in_features,
             " features per sample, got shape ", x.shape_string());
  return (*layers)(flat);
}

// ---- CNN ----
CNN::CNN(CNNOptions o) : nn::Module("CNN"), options(std::move(o)) {
  auto size = hw(options.input_size);
  KILN_CHECK(size[0] >= 4 && size[1] >= 4, ValueError, "CNN: input_size must be at least 4x4, got ", size[0], "x",
             size[1]);
  KILN_CHECK(options.in_channels > 0 && options.channels1 > 0 && options.channels2 > 0 && options.hidden > 0 &&
                 options.num_classes > 0,
             ValueError, "CNN: channel, hidden and class counts must be > 0");
  conv1 = register_module(
      "conv1",
      std::make_shared<nn::Conv2d>(nn::Conv2dOptions{
          .in_channels = options.in_channels, .out_channels = options.channels1, .kernel_size = {3}, .padding = {1}}));
  conv2 = register_module(
      "conv2",
      std::make_shared<nn::Conv2d>(nn::Conv2dOptions{
          .in_channels = options.channels1, .out_channels = options.channels2, .kernel_size = {3}, .padding = {1}}));
  int64_t flat = options.channels2 * (size[0] / 4) * (size[1] / 4);
  fc1 = register_module(
      "fc1", std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = flat, .out_features = options.hidden}));
  fc2 = register_module("fc2", std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = options.hidden,
                                                                              .out_features = options.num_classes}));
}

Tensor CNN::forward(const Tensor& x) {
  auto size = hw(options.input_size);
  KILN_CHECK(x.dim() == 4 && x.size(1) == options.in_channels && x.size(2) == size[0] && x.size(3) == size[1],
             ShapeError, "CNN: expected input [N, ", options.in_channels, ", ", size[0], ", ", size[1], "], got shape ",
             x.shape_string());
  Tensor y = max_pool2d((*conv1)(x).relu(), 2);
  y = max_pool2d((*conv2)(y).relu(), 2);
  return (*fc2)((*fc1)(y.flatten(1)).relu());
}

// ---- ResNet ----
BasicBlock::BasicBlock(BasicBlockOptions o) : nn::Module("BasicBlock"), options(o) {
  KILN_CHECK(o.in_channels > 0 && o.out_channels > 0 && o.stride > 0, ValueError,
             "BasicBlock: channels and stride must be > 0, got in_channels=", o.in_channels,
             " out_channels=", o.out_channels, " stride=", o.stride);
  auto bn = [&] { return std::make_shared<nn::BatchNorm2d>(nn::BatchNormOptions{.num_features = o.out_channels}); };
  conv1 = register_module("conv1", std::make_shared<nn::Conv2d>(nn::Conv2dOptions{.in_channels = o.in_channels,
                                                                                  .out_channels = o.out_channels,
                                                                                  .kernel_size = {3},
                                                                                  .stride = {o.stride},
                                                                                  .padding = {1},
                                                                                  .bias = false}));
  bn1 = register_module("bn1", bn());
  conv2 = register_module("conv2", std::make_shared<nn::Conv2d>(nn::Conv2dOptions{.in_channels = o.out_channels,
                                                                                  .out_channels = o.out_channels,
                                                                                  .kernel_size = {3},
                                                                                  .padding = {1},
                                                                                  .bias = false}));
  bn2 = register_module("bn2", bn());
  if (o.stride != 1 || o.in_channels != o.out_channels) {
    downsample =
        register_module("downsample", std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
                                          std::make_shared<nn::Conv2d>(nn::Conv2dOptions{.in_channels = o.in_channels,
                                                                                         .out_channels = o.out_channels,
                                                                                         .kernel_size = {1},
                                                                                         .stride = {o.stride},
                                                                                         .bias = false}),
                                          bn()}));
  }
}

Tensor BasicBlock::forward(const Tensor& x) {
  Tensor y = bn1->forward_relu((*conv1)(x));
  return bn2->forward_add_relu((*conv2)(y), downsample ? (*downsample)(x) : x);
}

namespace {
// f() is (part of) a checkpointed segment's forward over `modules`. Its rerun
// in backward must not count the batch into BatchNorm's running statistics a
// second time (torch's checkpoint does): the buffers are put back as the
// forward left them, so a checkpointed step leaves what an uncheckpointed one does.
template <typename F>
Tensor stats_counted_once(std::initializer_list<const nn::Module*> modules, F&& f) {
  if (!nn::is_recomputing()) return f();
  std::vector<Tensor> buffers, state;
  for (const nn::Module* m : modules) {
    if (m == nullptr || !m->is_training()) continue;
    for (const Tensor& b : m->buffers()) {
      if (!b.defined()) continue;
      buffers.push_back(b);
      state.push_back(b.clone());
    }
  }
  Tensor out = f();
  const NoGradGuard no_grad;
  for (size_t k = 0; k < buffers.size(); ++k) buffers[k].copy_(state[k]);
  return out;
}
}  // namespace

Tensor BasicBlock::forward_split_checkpointed(const Tensor& x, const std::string& name) {
  KILN_CHECK(downsample != nullptr, ValueError, "BasicBlock ", name,
             ": forward_split_checkpointed is for a block with a downsample shortcut");
  // The lambdas hold the modules: a segment runs again in backward.
  const Tensor r = nn::checkpoint(
      [c = conv1, b = bn1](const TensorList& in) -> TensorList {
        return {stats_counted_once({b.get()}, [&] { return b->forward_relu((*c)(in[0])); })};
      },
      {x}, name + ".conv1")[0];
  const Tensor d = nn::checkpoint(
      [ds = downsample](const TensorList& in) -> TensorList {
        return {stats_counted_once({ds.get()}, [&] { return (*ds)(in[0]); })};
      },
      {x}, name + ".downsample")[0];
  return nn::checkpoint(
      [c = conv2, b = bn2](const TensorList& in) -> TensorList {
        return {stats_counted_once({b.get()}, [&] { return b->forward_add_relu((*c)(in[0]), in[1]); })};
      },
      {r, d}, name + ".conv2")[0];
}

ResNet::ResNet(ResNetOptions o) : nn::Module("ResNet"), options(std::move(o)) {
  KILN_CHECK(!options.widths.empty() && options.widths.size() == options.blocks.size(), ValueError,
             "ResNet: widths and blocks must be non-empty and of equal length, got ", options.widths.size(), " and ",
             options.blocks.size());
  KILN_CHECK(options.in_channels > 0 && options.stem_channels > 0 && options.num_classes > 0, ValueError,
             "ResNet: in_channels, stem_channels and num_classes must be > 0");
  conv1 = register_module("conv1", std::make_shared<nn::Conv2d>(nn::Conv2dOptions{.in_channels = options.in_channels,
                                                                                  .out_channels = options.stem_channels,
                                                                                  .kernel_size = {3},
                                                                                  .padding = {1},
                                                                                  .bias = false}));
  bn1 = register_module("bn1",
                        std::make_shared<nn::BatchNorm2d>(nn::BatchNormOptions{.num_features = options.stem_channels}));
  int64_t c = options.stem_channels;
  for (size_t i = 0; i < options.widths.size(); ++i) {
    KILN_CHECK(options.blocks[i] > 0, ValueError, "ResNet: blocks per stage must be > 0, got ", options.blocks[i],
               " for stage ", i + 1);
    auto stage = std::make_shared<nn::Sequential>();
    for (int64_t b = 0; b < options.blocks[i]; ++b) {
      int64_t stride = (i > 0 && b == 0) ? 2 : 1;
      stage->push_back(std::make_shared<BasicBlock>(
          BasicBlockOptions{.in_channels = c, .out_channels = options.widths[i], .stride = stride}));
      c = options.widths[i];
    }
    stages.push_back(register_module("layer" + std::to_string(i + 1), stage));
  }
  fc = register_module(
      "fc", std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = c, .out_features = options.num_classes}));
}

Tensor ResNet::forward(const Tensor& x) {
  KILN_CHECK(x.dim() == 4 && x.size(1) == options.in_channels, ShapeError, "ResNet: expected input [N, ",
             options.in_channels, ", H, W], got shape ", x.shape_string());
  if (!checkpointing.enabled() || !grad_mode_enabled()) {
    Tensor y = bn1->forward_relu((*conv1)(x));
    for (auto& s : stages) y = (*s)(y);
    return (*fc)(y.mean({2, 3}));
  }
  // The stem's output is at full resolution, as large as anything in the
  // network: keep only the image and recompute it in backward.
  Tensor y = nn::checkpoint(
      [c = conv1, b = bn1](const TensorList& in) -> TensorList {
        return {stats_counted_once({b.get()}, [&] { return b->forward_relu((*c)(in[0])); })};
      },
      {x}, "stem")[0];
  std::vector<std::shared_ptr<BasicBlock>> blocks;
  std::vector<std::string> names;
  for (size_t i = 0; i < stages.size(); ++i) {
    const std::vector<nn::ModulePtr> children = stages[i]->children();
    for (size_t b = 0; b < children.size(); ++b) {
      blocks.push_back(std::static_pointer_cast<BasicBlock>(children[b]));
      names.push_back("layer" + std::to_string(i + 1) + "." + std::to_string(b));
    }
  }
  const auto n = static_cast<int64_t>(blocks.size());
  if (checkpointing.every == 1) {
    // A block with a downsample shortcut reads the previous stage's larger
    // output: recomputed as one segment, its backward holds that input, every
    // activation of the block and their gradients at once (the activation peak
    // of the resnet workload). Three segments, each recomputed when backward
    // reaches it, hold one branch at a time. The last block runs plainly, as
    // run_blocks leaves its last run (docs/memory.md).
    for (int64_t i = 0; i + 1 < n; ++i) {
      const std::shared_ptr<BasicBlock>& blk = blocks[static_cast<size_t>(i)];
      const std::string& name = names[static_cast<size_t>(i)];
      if (blk->downsample) {
        y = blk->forward_split_checkpointed(y, name);
        continue;
      }
      y = nn::checkpoint(
          [blk](const TensorList& in) -> TensorList {
            return {stats_counted_once({blk.get()}, [&] { return (*blk)(in[0]); })};
          },
          {y}, name)[0];
    }
    y = (*blocks.back())(y);
    return (*fc)(y.mean({2, 3}));
  }
  y = nn::run_blocks(
      checkpointing, n,
      [blocks](int64_t i, const Tensor& t) {
        const nn::Module* b = blocks[static_cast<size_t>(i)].get();
        return stats_counted_once({b}, [&] { return (*blocks[static_cast<size_t>(i)])(t); });
      },
      y, "blocks");
  return (*fc)(y.mean({2, 3}));
}

}  // namespace kiln::models
