// Runs an exported .onnx file in the consumers kiln's export must satisfy
// (issue 21): the ONNX checker (python3-onnx, full check with shape
// inference), ONNX Runtime (the npm package onnxruntime-node, which
// scripts/setup.sh installs under /usr/local/share/kiln/npm) and OpenCV DNN
// (python3-opencv's cv2.dnn.readNetFromONNX), each on the same inputs, and
// reads their outputs back as tensors. Used by tests/export and tests/cli.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "kiln/core/tensor.h"

namespace kiln::test {

struct OnnxConsumerRun {
  bool checker_ok = false;
  std::string checker_error;
  /// "onnxruntime" and (when asked for and it loaded the model) "opencv": one output per input.
  std::map<std::string, std::vector<Tensor>> outputs;
  /// Why OpenCV refused the model ("" when it ran it or was not asked).
  std::string opencv_error;
  std::string log;  // the scripts' output, for failure messages
};

/// Runs `model` on each of `inputs` (fed as the graph input "input") in ONNX
/// Runtime and, when `opencv`, OpenCV DNN; checks it with the ONNX checker
/// first. Files go under `dir`. Throws std::runtime_error with the scripts'
/// output when a consumer cannot be started at all (a missing dependency:
/// run scripts/setup.sh) or ONNX Runtime fails.
OnnxConsumerRun run_onnx_consumers(const std::string& model, const std::vector<Tensor>& inputs, bool opencv,
                                   const std::string& dir);

/// max |got - want| / max |want|: the difference relative to the output's scale.
/// Infinity when the shapes differ.
double scaled_max_diff(const Tensor& got, const Tensor& want);

}  // namespace kiln::test
