// ONNX export: a kiln module (or a captured export::Graph) as an .onnx file
// that ONNX Runtime, OpenCV DNN and the ONNX checker load. The file is written
// through Debian's ONNX protobuf classes (libonnx-dev's onnx::ModelProto), never
// by hand; weights go in as initializers under their state_dict() names.
// A model whose file would pass protobuf's 2 GiB message limit keeps its
// large initializers in a side file "<model>.onnx.data" (ONNX's external-data
// convention), which ONNX Runtime, the ONNX checker and load_onnx read.
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

/// Where initializers' bytes go: inline in the model file (raw_data), or in
/// one side file next to it per ONNX's external-data convention
/// (TensorProto.data_location = EXTERNAL, external_data "location" relative to
/// the model's directory, "offset", "length").
struct ExternalDataOptions {
  enum class Mode {
    /// Inline, unless the model file would reach `limit_bytes`: then every
    /// initializer of at least `min_bytes` goes to the side file.
    kAutomatic,
    /// Every initializer of at least `min_bytes` goes to the side file, whatever
    /// the model's size (kiln export --external-data).
    kAlways,
    /// Always inline; a model past `limit_bytes` is refused.
    kNever,
  };
  Mode mode = Mode::kAutomatic;
  /// Initializers smaller than this stay inline (shapes, biases: a consumer
  /// then needs no file read for them). ONNX's own converter uses 1024 too.
  int64_t min_bytes = 1024;
  /// Each tensor's offset in the side file is a multiple of this: 4096, the
  /// page size, so a consumer may mmap a tensor in place.
  int64_t alignment = 4096;
  /// The side file's name, in the model's directory; empty: "<model file name>.data".
  /// A plain file name: no directories.
  std::string location;
  /// The model size from which kAutomatic goes external: protobuf's limit for
  /// one message (2^31 - 1 bytes). Tests lower it rather than write 2 GiB.
  int64_t limit_bytes = 2147483647;
};

/// Whether a model of `inline_bytes` (its size with every initializer inline)
/// keeps initializers in a side file under `options`.
bool use_external_data(int64_t inline_bytes, const ExternalDataOptions& options);

struct OnnxOptions {
  /// Per input name, the axes left symbolic (see CaptureOptions::dynamic_axes).
  std::map<std::string, std::map<int64_t, std::string>> dynamic_axes;
  /// ONNX operator set, 13 to 17 (17: LayerNormalization as one node).
  int64_t opset = 17;
  /// Written into the model's producer and doc fields.
  std::string doc;
  /// Inline weights or a side file (default: a side file only past 2 GiB).
  ExternalDataOptions external_data;
};

/// What an export wrote.
struct OnnxReport {
  std::string path;
  int64_t nodes = 0;
  int64_t initializers = 0;
  int64_t parameters = 0;  // elements across initializers
  int64_t bytes = 0;       // of the model file
  /// The side file holding external initializers ("" when all are inline), its
  /// size in bytes (padding included) and how many initializers it holds.
  std::string data_path;
  int64_t data_bytes = 0;
  int64_t external_initializers = 0;
  std::map<std::string, int64_t> op_counts;
};

/// Writes `graph` as an ONNX model (IR version 8) at `path`, and its side file
/// when `external` sends initializers there. Both are written to temporaries
/// first and renamed into place (side file first), so a failed export leaves
/// no half-written file under either name. Throws IOError when a file cannot
/// be written, ValueError when the model stays past protobuf's 2 GiB limit
/// (kNever) or `external` is invalid.
OnnxReport write_onnx(const Graph& graph, const std::string& path, int64_t opset, const std::string& doc = {},
                      const ExternalDataOptions& external = {});

/// capture(module, example_inputs) then write_onnx: the module's inference
/// forward as an ONNX file.
OnnxReport to_onnx(nn::Module& module, const std::vector<Tensor>& example_inputs, const std::string& path,
                   const OnnxOptions& options = {});

}  // namespace kiln::exporter
