// The consumers of an exported ONNX file, run as their own users run them
// (tests/support/onnx_consumers.h): a Python script for the checker and
// OpenCV, a Node script for ONNX Runtime. Tensors travel as raw little-endian
// files described by a JSON manifest.
#include "support/onnx_consumers.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "kiln/ops/factory.h"
#include "support/test_util.h"

namespace kiln::test {
namespace {

constexpr const char* kNpmModules = "/usr/local/share/kiln/npm/node_modules";

constexpr const char* kPythonScript = R"PY(
import json, sys
import numpy as np
m = json.load(open(sys.argv[1]))
res = {"checker": None, "opencv": None, "opencv_shapes": []}
try:
    import onnx
    # The path form: the checker resolves external data against the model's directory.
    onnx.checker.check_model(m["model"], full_check=True)
except Exception as e:
    res["checker"] = "%s: %s" % (type(e).__name__, e)
if m["opencv"]:
    try:
        import cv2
        net = cv2.dnn.readNetFromONNX(m["model"])
        for i, inp in enumerate(m["inputs"]):
            x = np.fromfile(inp["file"], dtype=inp["dtype"]).reshape(inp["shape"])
            net.setInput(x, "input")
            y = np.ascontiguousarray(net.forward(), dtype=np.float32)
            y.tofile(m["out"] + ".opencv.%d.bin" % i)
            res["opencv_shapes"].append(list(y.shape))
    except Exception as e:
        res["opencv"] = ("%s: %s" % (type(e).__name__, e)).strip()
json.dump(res, open(m["out"] + ".py.json", "w"))
print("python consumers done")
)PY";

constexpr const char* kNodeScript = R"JS(
const ort = require('onnxruntime-node');
const fs = require('fs');
const m = JSON.parse(fs.readFileSync(process.argv[2]));
(async () => {
  const session = await ort.InferenceSession.create(m.model, {intraOpNumThreads: 1, interOpNumThreads: 1});
  const shapes = [];
  for (let i = 0; i < m.inputs.length; ++i) {
    const inp = m.inputs[i];
    const bytes = new Uint8Array(fs.readFileSync(inp.file)).buffer;  // a fresh, aligned copy
    const data = inp.dtype === 'float32' ? new Float32Array(bytes) : new BigInt64Array(bytes);
    const out = await session.run({input: new ort.Tensor(inp.dtype, data, inp.shape)});
    const y = out.output;
    if (y.type !== 'float32') throw new Error('output of type ' + y.type + ', expected float32');
    fs.writeFileSync(m.out + '.ort.' + i + '.bin', Buffer.from(y.data.buffer, y.data.byteOffset, y.data.byteLength));
    shapes.push(y.dims.map(Number));
  }
  fs.writeFileSync(m.out + '.ort.json', JSON.stringify(shapes));
  console.log('onnxruntime done');
})().catch((e) => { console.error('onnxruntime: ' + e); process.exit(1); });
)JS";

void write_raw(const std::string& path, const Tensor& t) {
  const std::vector<uint8_t> bytes = contiguous_bytes(t);
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

Tensor read_float32(const std::string& path, const std::vector<int64_t>& shape) {
  const std::string bytes = read_file(path);
  std::vector<float> v(bytes.size() / sizeof(float));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(float));
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  if (n != static_cast<int64_t>(v.size()))
    throw std::runtime_error(path + ": " + std::to_string(v.size()) + " floats for a shape of " + std::to_string(n));
  return tensor(v, shape);
}

}  // namespace

OnnxConsumerRun run_onnx_consumers(const std::string& model, const std::vector<Tensor>& inputs, bool opencv,
                                   const std::string& dir) {
  const std::string base = dir + "/" + std::filesystem::path(model).stem().string();
  nlohmann::json manifest{{"model", model}, {"opencv", opencv}, {"out", base}, {"inputs", nlohmann::json::array()}};
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::string file = base + ".in." + std::to_string(i) + ".bin";
    write_raw(file, inputs[i]);
    manifest["inputs"].push_back({{"file", file},
                                  {"shape", std::vector<int64_t>(inputs[i].sizes().begin(), inputs[i].sizes().end())},
                                  {"dtype", inputs[i].dtype() == kInt64 ? "int64" : "float32"}});
  }
  {
    std::ofstream(base + ".json") << manifest.dump();
    std::ofstream(dir + "/consumers.py") << kPythonScript;
    std::ofstream(dir + "/consumers.js") << kNodeScript;
  }
  OnnxConsumerRun r;
  std::string out;
  int rc = run_command(shell_quote(python()) + " " + shell_quote(dir + "/consumers.py") + " " +
                           shell_quote(base + ".json"),
                       out);
  r.log += out;
  if (rc != 0) throw std::runtime_error("the ONNX checker / OpenCV script failed to run (scripts/setup.sh installs "
                                        "python3-onnx and python3-opencv):\n" + out);
  const auto py = nlohmann::json::parse(read_file(base + ".py.json"));
  r.checker_ok = py["checker"].is_null();
  if (!r.checker_ok) r.checker_error = py["checker"].get<std::string>();
  if (opencv) {
    if (py["opencv"].is_null()) {
      for (size_t i = 0; i < inputs.size(); ++i)
        r.outputs["opencv"].push_back(read_float32(base + ".opencv." + std::to_string(i) + ".bin",
                                                   py["opencv_shapes"][i].get<std::vector<int64_t>>()));
    } else {
      r.opencv_error = py["opencv"].get<std::string>();
    }
  }
  rc = run_command(std::string("NODE_PATH=") + kNpmModules + " node " + shell_quote(dir + "/consumers.js") + " " +
                       shell_quote(base + ".json"),
                   out);
  r.log += out;
  if (rc != 0) throw std::runtime_error("ONNX Runtime (onnxruntime-node under " + std::string(kNpmModules) +
                                        ", installed by scripts/setup.sh) failed:\n" + out);
  const auto shapes = nlohmann::json::parse(read_file(base + ".ort.json"));
  for (size_t i = 0; i < inputs.size(); ++i)
    r.outputs["onnxruntime"].push_back(
        read_float32(base + ".ort." + std::to_string(i) + ".bin", shapes[i].get<std::vector<int64_t>>()));
  return r;
}

double scaled_max_diff(const Tensor& got, const Tensor& want) {
  if (got.sizes() != want.sizes()) return std::numeric_limits<double>::infinity();
  const std::vector<double> a = to_doubles(got), b = to_doubles(want);
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(b[i]));
    if (std::isnan(a[i]) != std::isnan(b[i])) return std::numeric_limits<double>::infinity();
  }
  return diff / std::max(scale, 1e-12);
}

}  // namespace kiln::test
