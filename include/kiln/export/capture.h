// export::capture: a module's inference forward as an export::Graph.
//
// Capture is module-level (docs/export.md): the exporter knows each module
// type of nn and the model zoo — Linear, Conv2d, BatchNorm1d/2d, LayerNorm,
// Embedding, Dropout, Identity, ReLU/GELU/SiLU/Tanh/Sigmoid/Softmax,
// MaxPool2d/AvgPool2d/AdaptiveAvgPool2d, Flatten, Sequential, the
// transformer's attention, MLP and block, and models::MLP, CNN, BasicBlock,
// ResNet, ViT and GPT — and writes the ONNX nodes each one's forward computes,
// walking the module tree in forward order. A module it does not know (a user
// class with its own forward, nn::Functional, a subclass that overrides a
// known forward) or a module with forward hooks is refused with an error that
// names the module's path and type, rather than exported wrongly.
//
// The capture is checked against the model itself: the module runs on the
// example inputs and its output shape must be the graph's output shape with
// the symbolic dims bound to the example's sizes.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kiln/export/graph.h"
#include "kiln/nn/module.h"

namespace kiln::exporter {

struct CaptureOptions {
  /// Per graph input name, the axes left symbolic and their names, as
  /// torch.onnx.export's dynamic_axes: {{"input", {{0, "batch"}}}}. Graph inputs
  /// are named "input" (one input). Other axes are fixed to the example's sizes.
  std::map<std::string, std::map<int64_t, std::string>> dynamic_axes;
  /// The ONNX operator set the nodes follow: 13 to 17. Below 17, LayerNorm is
  /// written out as its reductions (LayerNormalization is an opset-17 operator)
  /// for consumers that lack it.
  int64_t opset = 17;
};

/// The inference graph of `module` (run in eval mode; its train/eval mode is
/// restored afterwards) for inputs shaped like `example_inputs`. Throws
/// ValueError naming the module path and type it cannot export, ShapeError
/// when the example input does not fit the model.
Graph capture(nn::Module& module, const std::vector<Tensor>& example_inputs, const CaptureOptions& options = {});

}  // namespace kiln::exporter
