// The built-in kernels of exporter::Session (runtime.h), by ONNX op type.
// Private to src/export.
#pragma once

#include <map>
#include <string>

#include "kiln/export/runtime.h"

namespace kiln::exporter::detail {

/// Every built-in KernelFactory, by op type (ONNX semantics at opsets 13 to 18).
const std::map<std::string, KernelFactory>& builtin_kernels();

/// "node 'conv1/Conv' (Conv)": how errors name a node.
std::string node_label(const Node& node);

}  // namespace kiln::exporter::detail
