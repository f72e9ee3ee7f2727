// `kiln eval --int8` and `kiln export --int8` (src/cli/int8_model.h).
#include "cli/int8_model.h"

#include <cstdio>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/data/loader.h"
#include "kiln/export/capture.h"
#include "kiln/export/onnx.h"
#include "kiln/export/runtime.h"
#include "kiln/io/safetensors.h"
#include "kiln/ops/factory.h"
#include "kiln/quant/fuse.h"
#include "kiln/quant/ptq.h"

namespace kiln::cli {
namespace fs = std::filesystem;

fs::path int8_file_of(const fs::path& target, const std::string& file) {
  if (!file.empty()) return file;
  return fs::is_directory(target) ? target / "model.int8.safetensors" : target.parent_path() / "model.int8.safetensors";
}

std::pair<Config, Task> load_int8_model(const fs::path& target, const fs::path& int8_file, const std::string& which) {
  if (!fs::is_regular_file(int8_file))
    throw ConfigError("--int8: expected an int8 model at " + int8_file.string() +
                      ", got no such file (write it with `kiln quantize " + target.string() + "`)");
  const auto header = io::read_safetensors_header(int8_file.string());
  auto loaded = load_for_eval(checkpoint_of(target, which));
  Task& task = loaded.second;
  if (task.gpt)
    throw ConfigError("--int8: the int8 models are image models (`kiln quantize` quantizes Conv2d and Linear); " +
                      target.string() + " is a language model");
  auto fb = header.metadata.find("fuse_bn");
  if (fb != header.metadata.end() && fb->second == "true") quant::fuse_conv_bn(*task.model);
  quant::load_quantized(*task.model, int8_file.string());
  task.model->eval();
  return loaded;
}

int evaluate_int8_command(const fs::path& target, const std::string& int8_file, const std::string& split,
                          int64_t max_batches, const std::string& which) {
  if (split != "test" && split != "train") throw ConfigError("--split expects test or train, got \"" + split + "\"");
  const fs::path file = int8_file_of(target, int8_file);
  auto [config, task] = load_int8_model(target, file, which);
  const EvalResult r = evaluate(task, config, split, max_batches);
  std::printf("%s (int8), %s split, %lld samples\n", file.string().c_str(), split.c_str(),
              static_cast<long long>(r.samples));
  std::printf("loss %.4f  accuracy %.2f%%\n", r.loss, 100 * r.accuracy);
  return 0;
}

int export_int8_command(const fs::path& target, const std::string& int8_file, const ExportOptions& o) {
  if (o.format != "onnx") throw ConfigError("--int8 exports ONNX (QDQ form); --format " + o.format + " is not");
  if (o.check || o.optimize || o.external_data || !o.dtype.empty())
    throw ConfigError("--int8: --check, --optimize, --external-data and --dtype are for float exports");
  if (o.opset < 13 || o.opset > 17)
    throw ConfigError("--opset expects 13 to 17 (per-channel DequantizeLinear needs 13), got " +
                      std::to_string(o.opset));
  if (!o.dynamic.empty() && o.dynamic != "batch" && o.dynamic != "none")
    throw ConfigError("--dynamic expects batch or none for an image model, got \"" + o.dynamic + "\"");
  const fs::path file = int8_file_of(target, int8_file);
  auto [config, task] = load_int8_model(target, file, o.checkpoint);
  std::vector<int64_t> shape{1};
  shape.insert(shape.end(), task.sample_shape.begin(), task.sample_shape.end());
  std::map<int64_t, std::string> dynamic;
  if (o.dynamic != "none") dynamic[0] = "batch";
  const exporter::Graph graph = exporter::capture(*task.model, {zeros(shape, TensorOptions(kFloat32))},
                                                  {.dynamic_axes = {{"input", dynamic}}, .opset = o.opset});
  fs::path out = o.out;
  if (out.empty()) out = fs::is_directory(target) ? target / "model.int8.onnx" : file.parent_path() / "model.int8.onnx";
  const auto r = exporter::write_onnx(graph, out.string(), o.opset, "kiln int8 model of " + file.string());
  const auto ops = graph.op_counts();
  const auto count = [&](const char* op) { return ops.count(op) ? static_cast<long long>(ops.at(op)) : 0LL; };
  std::printf("wrote %s: the int8 model of %s as ONNX in QDQ form, opset %lld\n", out.string().c_str(),
              file.string().c_str(), static_cast<long long>(o.opset));
  std::printf("  %lld nodes: %lld QuantizeLinear, %lld DequantizeLinear (int8 weights per channel); %lld bytes\n",
              static_cast<long long>(r.nodes), count("QuantizeLinear"), count("DequantizeLinear"),
              static_cast<long long>(r.bytes));

  // The file read back and run by kiln's runtime on a test batch, against the eager int8 model.
  data::DataLoader<> loader(task.eval_set, {.batch_size = dynamic.empty() ? 1 : 64, .seed = 0});
  const Tensor x = (*loader.begin()).data.contiguous();
  Tensor eager;
  {
    const NoGradGuard no_grad;
    eager = (*task.model)(x).contiguous();
  }
  const Tensor got = exporter::Session(exporter::load_onnx(out.string())).run({x})[0].contiguous();
  const double scale = eager.abs().max().item<float>();
  const double diff = got.sub(eager).abs().max().item<float>() / (scale > 0 ? scale : 1.0);
  const Tensor same = got.argmax(1).eq(eager.argmax(1)).to(kFloat32).mean();
  std::printf("  kiln's runtime on %lld test images: max |diff| %.2e of the output's scale, argmax agreement %.2f%%\n",
              static_cast<long long>(x.size(0)), diff, 100.0 * same.item<float>());
  if (diff > 1e-5)
    throw ValueError("kiln export --int8: " + out.string() + " does not compute what the int8 model does (" +
                     std::to_string(diff) + " of the output's scale)");
  return 0;
}

}  // namespace kiln::cli
