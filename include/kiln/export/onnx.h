// ONNX export: a kiln module (or a captured export::Graph) as an .onnx file
// that ONNX Runtime, OpenCV DNN and the ONNX checker load. The file is written
// through Debian's ONNX protobuf classes (libonnx-dev's onnx::ModelProto), never
// by hand; weights go in as initializers under their state_dict() names.
//
//   models::ResNet net;
//   exporter::to_onnx(net, {torch_like_example}, "resnet.onnx",
//                     {.dynamic_axes = {{"input", {{0, "batch"}}}}});
//
// (The namespace is kiln::exporter: `export` is a C++ keyword.)
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kiln/export/capture.h"
#include "kiln/export/graph.h"
#include "kiln/nn/module.h"

namespace kiln::exporter {

struct OnnxOptions {
  /// Per input name, the axes left symbolic (see CaptureOptions::dynamic_axes).
  std::map<std::string, std::map<int64_t, std::string>> dynamic_axes;
  /// ONNX operator set, 13 to 17 (17: LayerNormalization as one node).
  int64_t opset = 17;
  /// Written into the model's producer and doc fields.
  std::string doc;
};

/// What an export wrote.
struct OnnxReport {
  std::string path;
  int64_t nodes = 0;
  int64_t initializers = 0;
  int64_t parameters = 0;  // elements across initializers
  int64_t bytes = 0;       // of the file
  std::map<std::string, int64_t> op_counts;
};

/// Writes `graph` as an ONNX model (IR version 8) at `path`. Throws IOError
/// when the file cannot be written, ValueError past protobuf's 2 GiB message
/// limit (external data is not written yet).
OnnxReport write_onnx(const Graph& graph, const std::string& path, int64_t opset, const std::string& doc = {});

/// capture(module, example_inputs) then write_onnx: the module's inference
/// forward as an ONNX file.
OnnxReport to_onnx(nn::Module& module, const std::vector<Tensor>& example_inputs, const std::string& path,
                   const OnnxOptions& options = {});

}  // namespace kiln::exporter
