// models::CNN: the LeNet-style convolutional classifier of the "cnn" workload
// (bench/WORKLOADS.md): conv1 → ReLU → MaxPool 2 → conv2 → ReLU → MaxPool 2 →
// flatten → fc1 → ReLU → fc2. Convolutions are 3×3 with padding 1.
//
// PyTorch twin (tests/parity/models_twins.py), whose state_dict names this
// model's equal (conv1.*, conv2.*, fc1.*, fc2.*, as PyTorch's MNIST example):
//   class CNN(nn.Module):
//       def __init__(self, in_channels=1, channels1=32, channels2=64, hidden=128,
//                    num_classes=10, input_size=(28, 28)):
//           super().__init__()
//           self.conv1 = nn.Conv2d(in_channels, channels1, 3, padding=1)
//           self.conv2 = nn.Conv2d(channels1, channels2, 3, padding=1)
//           self.fc1 = nn.Linear(channels2 * (input_size[0] // 4) * (input_size[1] // 4), hidden)
//           self.fc2 = nn.Linear(hidden, num_classes)
//       def forward(self, x):
//           x = F.max_pool2d(F.relu(self.conv1(x)), 2)
//           x = F.max_pool2d(F.relu(self.conv2(x)), 2)
//           return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kiln/nn/layers.h"

namespace kiln::models {

struct CNNOptions {
  int64_t in_channels = 1;
  int64_t channels1 = 32;  // conv1's output channels
  int64_t channels2 = 64;  // conv2's output channels
  int64_t hidden = 128;    // fc1's output features
  int64_t num_classes = 10;
  std::vector<int64_t> input_size = {28, 28};  // {H, W} (or one value for both); fixes fc1's in_features
};

/// Input [N, in_channels, H, W] with {H, W} = input_size; output [N, num_classes].
class CNN : public nn::Module {
 public:
  explicit CNN(CNNOptions o = {});
  Tensor forward(const Tensor& x) override;
  const CNNOptions options;
  std::shared_ptr<nn::Conv2d> conv1, conv2;
  std::shared_ptr<nn::Linear> fc1, fc2;
};

}  // namespace kiln::models
