// `kiln export --check` (export_check.h). ONNX Runtime runs in node: a small
// script reads the input from a raw file, runs the session and writes every
// output (every node's, for the check) as a raw file with a JSON index of
// names, shapes and types.
#include "cli/export_check.h"

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli/config.h"
#include "kiln/core/error.h"
#include "kiln/export/onnx.h"
#include "kiln/export/runtime.h"
#include "kiln/ops/factory.h"

namespace kiln::cli {
namespace fs = std::filesystem;

namespace {

constexpr const char* kScript = R"JS(
const fs = require('fs');
let ort;
try { ort = require('onnxruntime-node'); } catch (e) { console.error('MISSING onnxruntime-node: ' + e.message); process.exit(3); }
const m = JSON.parse(fs.readFileSync(process.argv[2]));
(async () => {
  const session = await ort.InferenceSession.create(m.model, {intraOpNumThreads: 1, graphOptimizationLevel: 'disabled'});
  const bytes = new Uint8Array(fs.readFileSync(m.input)).buffer;
  const data = m.dtype === 'float32' ? new Float32Array(bytes) : new BigInt64Array(bytes);
  const out = await session.run({input: new ort.Tensor(m.dtype, data, m.shape)});
  const index = [];
  let i = 0;
  for (const name of session.outputNames) {
    const y = out[name];
    const file = m.dir + '/out.' + (i++) + '.bin';
    fs.writeFileSync(file, Buffer.from(y.data.buffer, y.data.byteOffset, y.data.byteLength));
    index.push({name: name, file: file, dims: y.dims.map(Number), type: y.type});
  }
  fs.writeFileSync(m.dir + '/outputs.json', JSON.stringify(index));
})().catch((e) => { console.error(String(e)); process.exit(1); });
)JS";

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// Runs `cmd` with stderr folded in; returns the exit status and the output.
int run(const std::string& cmd, std::string& output) {
  output.clear();
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return -1;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) output.append(buf, n);
  const int status = ::pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// A scratch directory, removed with its contents on destruction.
struct Scratch {
  fs::path path;
  Scratch() {
    std::string tmpl = (fs::temp_directory_path() / "kiln-export-check-XXXXXX").string();
    KILN_CHECK(::mkdtemp(tmpl.data()) != nullptr, IOError, "export check: cannot create a scratch directory under ",
               fs::temp_directory_path().string(), ": ", std::strerror(errno));
    path = tmpl;
  }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

}  // namespace

std::map<std::string, Tensor> run_onnxruntime(const fs::path& model, const Tensor& input, const fs::path& workdir) {
  const Tensor x = input.contiguous();
  {
    std::ofstream f(workdir / "input.bin", std::ios::binary);
    f.write(static_cast<const char*>(x.data_ptr()), static_cast<std::streamsize>(x.nbytes()));
    std::ofstream(workdir / "ort.js") << kScript;
    nlohmann::json m{{"model", model.string()},
                     {"input", (workdir / "input.bin").string()},
                     {"shape", std::vector<int64_t>(x.sizes().begin(), x.sizes().end())},
                     {"dtype", x.dtype() == kInt64 ? "int64" : "float32"},
                     {"dir", workdir.string()}};
    std::ofstream(workdir / "manifest.json") << m.dump();
  }
  std::string out;
  const int rc = run(std::string("NODE_PATH=") + kOnnxRuntimeModules + " node " + quote((workdir / "ort.js").string()) +
                         " " + quote((workdir / "manifest.json").string()),
                     out);
  if (rc == 127 || rc == 3 || rc == -1)
    throw ConfigError(
        "--check runs the model in ONNX Runtime, which needs node and the npm package onnxruntime-node "
        "under " +
        std::string(kOnnxRuntimeModules) + " (scripts/setup.sh installs both): " + out);
  KILN_CHECK(rc == 0, Error, "export check: ONNX Runtime failed on ", model.string(), ": ", out);
  std::map<std::string, Tensor> values;
  for (const auto& o : nlohmann::json::parse(slurp(workdir / "outputs.json"))) {
    const std::string bytes = slurp(o["file"].get<std::string>());
    const auto dims = o["dims"].get<std::vector<int64_t>>();
    // onnxruntime-node's names for the element types kiln's graphs compute.
    static const std::map<std::string, DType> kTypes{
        {"float32", kFloat32}, {"int64", kInt64}, {"int32", kInt32}, {"bool", kBool}, {"uint8", kUInt8}};
    const std::string type = o["type"].get<std::string>();
    KILN_CHECK(kTypes.count(type), Error, "export check: output ", o["name"].get<std::string>(), " has type ", type,
               "; the check reads float32, int64, int32, bool and uint8");
    Tensor t = empty(dims, TensorOptions(kTypes.at(type)));
    KILN_CHECK(static_cast<int64_t>(bytes.size()) == t.nbytes(), Error, "export check: output ", o["name"], " has ",
               bytes.size(), " bytes for shape ", t.shape_string());
    std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
    values[o["name"].get<std::string>()] = t;
  }
  return values;
}

exporter::NodeCheckReport check_export(nn::Module& module, const exporter::Graph& graph, const Tensor& input,
                                       int64_t opset, double tolerance, const fs::path& json) {
  const Scratch scratch;
  const fs::path model = scratch.path / "check.onnx";
  exporter::write_onnx(exporter::with_node_outputs(graph), model.string(), opset);
  const auto consumer = run_onnxruntime(model, input, scratch.path);
  const auto kiln_runtime = exporter::run_all_values(graph, {input});
  const auto kiln_eager = exporter::module_values(module, graph, input);
  exporter::NodeCheckReport report = exporter::compare_nodes(graph, consumer, kiln_runtime, kiln_eager, tolerance);
  if (!json.empty()) {
    std::ofstream f(json);
    f << report.json();
    KILN_CHECK(f.good(), IOError, "export check: cannot write the report to ", json.string());
  }
  return report;
}

}  // namespace kiln::cli
