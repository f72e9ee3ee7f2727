// Structured channel pruning that shrinks models::CNN and models::ResNet
// (include/kiln/quant/prune.h): ranking, the smaller layers, the masked twin,
// and the architecture's record in a file's metadata.
#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numeric>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/models/cnn.h"
#include "kiln/models/resnet.h"
#include "kiln/nn/layers.h"
#include "kiln/nn/norm.h"
#include "kiln/ops/factory.h"
#include "kiln/quant/prune.h"

namespace kiln::quant {
namespace {

using Index = std::vector<int64_t>;

Tensor take(const Tensor& t, int64_t dim, const Index& idx) {
  const NoGradGuard no_grad;
  return t.detach().index_select(dim, tensor(idx, {static_cast<int64_t>(idx.size())})).contiguous();
}

void set(Tensor& dst, const Tensor& src) {
  const NoGradGuard no_grad;
  dst.copy_(src);
}

Index first_n(int64_t n) {
  Index v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), int64_t{0});
  return v;
}

// The input columns of fc1 that read the kept conv2 channels (flatten is channel-major).
Index flat_columns(const Index& channels, int64_t per_channel) {
  Index cols;
  for (int64_t c : channels)
    for (int64_t j = 0; j < per_channel; ++j) cols.push_back(c * per_channel + j);
  return cols;
}

std::shared_ptr<nn::Conv2d> smaller_conv(const nn::Conv2d& old, const Index& out, const Index& in, bool training) {
  nn::Conv2dOptions o = old.options;
  o.out_channels = static_cast<int64_t>(out.size());
  o.in_channels = static_cast<int64_t>(in.size());
  auto c = std::make_shared<nn::Conv2d>(o);
  set(c->weight, take(take(old.weight, 0, out), 1, in));
  if (o.bias) set(c->bias, take(old.bias, 0, out));
  c->train(training);
  return c;
}

std::shared_ptr<nn::Linear> smaller_linear(const nn::Linear& old, const Index& out, const Index& in, bool training) {
  nn::LinearOptions o = old.options;
  o.out_features = static_cast<int64_t>(out.size());
  o.in_features = static_cast<int64_t>(in.size());
  auto l = std::make_shared<nn::Linear>(o);
  set(l->weight, take(take(old.weight, 0, out), 1, in));
  if (o.bias) set(l->bias, take(old.bias, 0, out));
  l->train(training);
  return l;
}

std::shared_ptr<nn::BatchNorm2d> smaller_bn(const nn::BatchNorm2d& old, const Index& keep, bool training) {
  nn::BatchNormOptions o = old.options;
  o.num_features = static_cast<int64_t>(keep.size());
  auto b = std::make_shared<nn::BatchNorm2d>(o);
  if (o.affine) {
    set(b->weight, take(old.weight, 0, keep));
    set(b->bias, take(old.bias, 0, keep));
  }
  if (o.track_running_stats) {
    set(b->running_mean, take(old.running_mean, 0, keep));
    set(b->running_var, take(old.running_var, 0, keep));
    set(b->num_batches_tracked, old.num_batches_tracked);
  }
  b->train(training);
  return b;
}

std::vector<std::pair<std::string, models::BasicBlock*>> blocks_of(models::ResNet& r) {
  std::vector<std::pair<std::string, models::BasicBlock*>> out;
  for (size_t s = 0; s < r.stages.size(); ++s) {
    int64_t b = 0;
    for (auto& child : r.stages[s]->children()) {
      auto* block = dynamic_cast<models::BasicBlock*>(child.get());
      if (block) out.emplace_back("layer" + std::to_string(s + 1) + "." + std::to_string(b), block);
      ++b;
    }
  }
  return out;
}

[[noreturn]] void not_covered(nn::Module& model) {
  throw ValueError("prune: channel pruning covers kiln's cnn and resnet models, got a " + model.type_name());
}

// Shrinks the CNN to the kept channel indices of conv1, conv2 and fc1.
void shrink_cnn(models::CNN& c, const Index& k1, const Index& k2, const Index& k3) {
  const bool tr = c.is_training();
  const int64_t per_channel = c.fc1->options.in_features / c.conv2->options.out_channels;
  auto conv1 = smaller_conv(*c.conv1, k1, first_n(c.conv1->options.in_channels), tr);
  auto conv2 = smaller_conv(*c.conv2, k2, k1, tr);
  auto fc1 = smaller_linear(*c.fc1, k3, flat_columns(k2, per_channel), tr);
  auto fc2 = smaller_linear(*c.fc2, first_n(c.fc2->options.out_features), k3, tr);
  c.conv1 = c.register_module("conv1", conv1);
  c.conv2 = c.register_module("conv2", conv2);
  c.fc1 = c.register_module("fc1", fc1);
  c.fc2 = c.register_module("fc2", fc2);
}

void shrink_block(models::BasicBlock& b, const Index& keep) {
  const bool tr = b.is_training();
  auto conv1 = smaller_conv(*b.conv1, keep, first_n(b.conv1->options.in_channels), tr);
  auto bn1 = smaller_bn(*b.bn1, keep, tr);
  auto conv2 = smaller_conv(*b.conv2, first_n(b.conv2->options.out_channels), keep, tr);
  b.conv1 = b.register_module("conv1", conv1);
  b.bn1 = b.register_module("bn1", bn1);
  b.conv2 = b.register_module("conv2", conv2);
}

// The kept indices of every unit for `amount` (L1 ranking of the producing layer's rows).
std::map<std::string, Index> choose(nn::Module& model, double amount) {
  std::map<std::string, Index> keep;
  auto pick = [&](const Tensor& w) { return l1_top_channels(w, channels_to_keep(w.size(0), amount)); };
  if (auto* c = dynamic_cast<models::CNN*>(&model)) {
    keep["conv1"] = pick(c->conv1->weight);
    keep["conv2"] = pick(c->conv2->weight);
    keep["fc1"] = pick(c->fc1->weight);
  } else if (auto* r = dynamic_cast<models::ResNet*>(&model)) {
    for (auto& [path, b] : blocks_of(*r)) keep[path] = pick(b->conv1->weight);
  } else {
    not_covered(model);
  }
  return keep;
}

void shrink(nn::Module& model, const std::map<std::string, Index>& keep) {
  if (auto* c = dynamic_cast<models::CNN*>(&model)) {
    shrink_cnn(*c, keep.at("conv1"), keep.at("conv2"), keep.at("fc1"));
  } else if (auto* r = dynamic_cast<models::ResNet*>(&model)) {
    for (auto& [path, b] : blocks_of(*r)) shrink_block(*b, keep.at(path));
  } else {
    not_covered(model);
  }
}

void zero_rows(Tensor& t, const Index& keep) {
  if (!t.defined()) return;
  const NoGradGuard no_grad;
  Tensor m = zeros({t.size(0)}, TensorOptions(kFloat32));
  for (int64_t k : keep) m.data_ptr<float>()[k] = 1.0f;
  std::vector<int64_t> shape(static_cast<size_t>(t.dim()), 1);
  shape[0] = t.size(0);
  t.detach().mul_(m.reshape(shape));
}

}  // namespace

std::vector<int64_t> l1_top_channels(const Tensor& weight, int64_t keep) {
  KILN_CHECK(weight.dim() >= 1 && keep >= 0 && keep <= weight.size(0), ValueError, "prune: cannot keep ", keep,
             " rows of a tensor of shape ", weight.shape_string());
  const Tensor w = weight.detach().to(kFloat32).contiguous();
  const int64_t rows = w.size(0), per_row = rows ? w.numel() / rows : 0;
  std::vector<double> norm(static_cast<size_t>(rows), 0.0);
  const float* x = w.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < per_row; ++j) norm[static_cast<size_t>(r)] += std::fabs(x[r * per_row + j]);
  Index order = first_n(rows);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return norm[static_cast<size_t>(a)] > norm[static_cast<size_t>(b)]; });
  order.resize(static_cast<size_t>(keep));
  std::sort(order.begin(), order.end());
  return order;
}

int64_t channels_to_keep(int64_t n, double amount) {
  KILN_CHECK(std::isfinite(amount) && amount >= 0.0 && amount < 1.0, ValueError,
             "prune: the channel amount expects a fraction in [0, 1), got ", amount);
  const int64_t keep = n - static_cast<int64_t>(std::nearbyint(amount * static_cast<double>(n)));
  KILN_CHECK(keep >= 1, ValueError, "prune: pruning ", amount, " of ", n, " channels would keep none");
  return keep;
}

ChannelCounts prune_channels(nn::Module& model, double amount) {
  const auto keep = choose(model, amount);
  shrink(model, keep);
  return channel_counts(model);
}

void mask_channels(nn::Module& model, double amount) {
  const auto keep = choose(model, amount);
  if (auto* c = dynamic_cast<models::CNN*>(&model)) {
    zero_rows(c->conv1->weight, keep.at("conv1"));
    zero_rows(c->conv1->bias, keep.at("conv1"));
    zero_rows(c->conv2->weight, keep.at("conv2"));
    zero_rows(c->conv2->bias, keep.at("conv2"));
    zero_rows(c->fc1->weight, keep.at("fc1"));
    zero_rows(c->fc1->bias, keep.at("fc1"));
  } else if (auto* r = dynamic_cast<models::ResNet*>(&model)) {
    for (auto& [path, b] : blocks_of(*r)) {
      zero_rows(b->conv1->weight, keep.at(path));
      zero_rows(b->bn1->weight, keep.at(path));
      zero_rows(b->bn1->bias, keep.at(path));
    }
  }
}

ChannelCounts channel_counts(nn::Module& model) {
  ChannelCounts n;
  if (auto* c = dynamic_cast<models::CNN*>(&model)) {
    n["conv1"] = c->conv1->options.out_channels;
    n["conv2"] = c->conv2->options.out_channels;
    n["fc1"] = c->fc1->options.out_features;
  } else if (auto* r = dynamic_cast<models::ResNet*>(&model)) {
    for (auto& [path, b] : blocks_of(*r)) n[path] = b->conv1->options.out_channels;
  } else {
    not_covered(model);
  }
  return n;
}

void shape_pruned_channels(nn::Module& model, const ChannelCounts& counts) {
  const ChannelCounts have = channel_counts(model);
  for (const auto& [unit, n] : counts) {
    auto it = have.find(unit);
    if (it == have.end()) {
      std::string units;
      for (const auto& [u, k] : have) units += (units.empty() ? "" : ", ") + u;
      throw ValueError("prune: the pruned channels name unit \"" + unit + "\", which this " + model.type_name() +
                       " does not have (its units: " + units + ")");
    }
    KILN_CHECK(n >= 1 && n <= it->second, ValueError, "prune: unit \"", unit, "\" expects 1 to ", it->second,
               " kept channels, got ", n);
  }
  std::map<std::string, Index> keep;
  for (const auto& [unit, n] : have) keep[unit] = first_n(counts.count(unit) ? counts.at(unit) : n);
  shrink(model, keep);
}

std::string channel_counts_json(const ChannelCounts& counts) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [unit, n] : counts) j[unit] = n;
  return j.dump();
}

ChannelCounts parse_channel_counts(const std::string& text, const std::string& source) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(source + ": " + kPrunedChannelsKey + " is not JSON (" + e.what() + ")");
  }
  if (!j.is_object())
    throw FormatError(source + ": " + kPrunedChannelsKey +
                      " expects a JSON object of unit names to channel counts, got " + j.type_name());
  ChannelCounts out;
  for (const auto& [unit, v] : j.items()) {
    if (!v.is_number_integer())
      throw FormatError(source + ": " + kPrunedChannelsKey + "[\"" + unit + "\"] expects an integer, got " + v.dump());
    out[unit] = v.get<int64_t>();
  }
  return out;
}

}  // namespace kiln::quant
