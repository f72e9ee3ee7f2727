// libFuzzer target: ONNX model files (kiln::exporter::load_onnx) and, for a
// file that loads, the Session compiled from it (every node's attributes
// checked by its kernel factory). Accepted outcomes: success, FormatError
// (the file), ValueError (an op, opset or attribute the runtime refuses) or
// DTypeError (an element type kiln lacks).
#include <string>

#include "fuzz_util.h"
#include "kiln/export/runtime.h"

namespace {

// What kiln may hold for one file: an initializer's elements widened from
// their smallest encoding (a one-byte varint per int64 element) to 8 bytes.
int64_t onnx_budget(size_t size) { return static_cast<int64_t>(size) * 8 + 256; }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kiln;
  static fuzz::ShmFile file("onnx");
  const std::string& path = file.write(data, size);
  fuzz::check_reader<ValueError, DTypeError>("load_onnx", onnx_budget(size), [&] {
    const exporter::Session session(exporter::load_onnx(path));
  });
  return 0;
}
