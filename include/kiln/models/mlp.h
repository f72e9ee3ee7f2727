// models::MLP: a multilayer perceptron (Linear → ReLU → … → Linear), the
// "mlp" and "tiny" workloads of bench/WORKLOADS.md.
//
// PyTorch twin (tests/parity/models_twins.py), whose state_dict names this
// model's equal ("layers.0.weight", "layers.0.bias", "layers.2.weight", …):
//   class MLP(nn.Module):
//       def __init__(self, in_features, hidden, out_features, bias=True):
//           super().__init__()
//           mods, d = [], in_features
//           for h in hidden: mods += [nn.Linear(d, h, bias=bias), nn.ReLU()]; d = h
//           mods.append(nn.Linear(d, out_features, bias=bias))
//           self.layers = nn.Sequential(*mods)
//       def forward(self, x): return self.layers(torch.flatten(x, 1))
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kiln/nn/layers.h"

namespace kiln::models {

struct MLPOptions {
  int64_t in_features = 784;
  std::vector<int64_t> hidden = {512, 512};  // one Linear + ReLU per entry
  int64_t out_features = 10;
  bool bias = true;
};

/// Input [N, ...] is flattened from dim 1 (so [N, 1, 28, 28] images work); output [N, out_features].
class MLP : public nn::Module {
 public:
  explicit MLP(MLPOptions o = {});
  Tensor forward(const Tensor& x) override;
  const MLPOptions options;
  std::shared_ptr<nn::Sequential> layers;
};

}  // namespace kiln::models
