// eval, sample and inspect.
#include "cli/commands.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>

#include "cli/export_check.h"
#include "cli/task.h"
#include "kiln/core/format.h"
#include "kiln/core/guards.h"
#include "kiln/export/onnx.h"
#include "kiln/export/optimize.h"
#include "kiln/io/safetensors.h"
#include "kiln/models/generate.h"
#include "kiln/nn/pytorch_weights.h"
#include "kiln/ops/factory.h"
#include "kiln/quant/prune.h"
#include "kiln/train/checkpoint.h"

namespace kiln::cli {
namespace fs = std::filesystem;
using json = nlohmann::json;

/// The checkpoint a target names: a file as given, a run directory's newest
/// usable one (passing over a newer file that is unusable is said, with why),
/// or with `which`, a run directory's "best" (train.keep_best), "latest" or
/// step N (ckpt-<N>.safetensors).
fs::path checkpoint_of(const fs::path& target, const std::string& which) {
  if (fs::is_regular_file(target)) {
    if (!which.empty())
      throw ConfigError("--checkpoint " + which + ": " + target.string() +
                        " is a checkpoint file already; --checkpoint picks one of a run directory's");
    return target;
  }
  if (!fs::exists(target)) throw ConfigError(target.string() + ": no such file or run directory");
  const fs::path dir = target / "checkpoints";
  if (which == "best") {
    const fs::path best = dir / kBestCheckpoint;
    if (!fs::is_regular_file(best))
      throw ConfigError(target.string() + ": no " + kBestCheckpoint +
                        " under checkpoints/ (the run needs train.keep_best and at least one evaluation)");
    return best;
  }
  if (!which.empty() && which != "latest") {
    const bool digits = which.find_first_not_of("0123456789") == std::string::npos && which.size() <= 18;
    if (!digits) throw ConfigError("--checkpoint expects latest, best or a step number, got \"" + which + "\"");
    char name[64];
    std::snprintf(name, sizeof name, "ckpt-%08lld.safetensors", std::stoll(which));
    if (!fs::is_regular_file(dir / name)) {
      std::string have;
      if (fs::is_directory(dir))
        for (const auto& p : train::CheckpointManager(dir).list()) {
          have += ' ';
          have += p.filename().string();
        }
      throw ConfigError(target.string() + ": no checkpoint of step " + which +
                        " (checkpoints/ holds:" + (have.empty() ? " none" : have) + ")");
    }
    return dir / name;
  }
  if (!fs::is_directory(dir))
    throw ConfigError(target.string() + ": no checkpoint under checkpoints/ (has the run saved one yet?)");
  train::CheckpointManager mgr(dir);
  const auto files = mgr.list();
  std::vector<std::string> skipped;
  for (auto it = files.rbegin(); it != files.rend(); ++it) {
    const std::string why = checkpoint_problem(*it);
    if (why.empty()) {
      for (const auto& s : skipped)
        std::fprintf(stderr, "kiln: warning: %s; using the older %s instead\n", s.c_str(),
                     it->filename().string().c_str());
      return *it;
    }
    skipped.push_back(it->string() + " is unusable (" + why + ")");
  }
  if (files.empty())
    throw ConfigError(target.string() + ": no checkpoint under checkpoints/ (has the run saved one yet?)");
  std::string msg = target.string() + ": no usable checkpoint under checkpoints/:";
  for (const auto& s : skipped) msg += "\n  " + s;
  throw ConfigError(msg);
}

/// The model (in eval mode, by construction) and data of a checkpoint, with its weights loaded.
std::pair<Config, Task> load_for_eval(const fs::path& ckpt) {
  const auto file = io::load_safetensors(ckpt.string());
  auto it = file.metadata.find("config");
  if (it == file.metadata.end() || it->second.empty())
    throw ConfigError(ckpt.string() +
                      ": not a kiln training checkpoint (no config in its metadata); "
                      "`kiln inspect` shows what it holds");
  Config config = Config::from_string(it->second, ckpt.string() + " (its config)");
  Task task = build_task(config, Purpose::Evaluate);
  // A channel-pruned model (kiln prune --channels) has smaller layers than its config builds.
  if (auto pc = file.metadata.find(quant::kPrunedChannelsKey); pc != file.metadata.end()) {
    try {
      quant::shape_pruned_channels(*task.model, quant::parse_channel_counts(pc->second, ckpt.string()));
    } catch (const ValueError& e) {
      throw FormatError(ckpt.string() + ": " + quant::kPrunedChannelsKey + " does not fit the model: " + e.what());
    }
  }
  io::NamedTensors weights;
  for (const auto& [name, t] : file.tensors)
    if (name.rfind("model.", 0) == 0) weights.emplace_back(name.substr(6), t);
  task.model->load_state_dict(weights);
  return {std::move(config), std::move(task)};
}

std::string checkpoint_problem(const fs::path& path) {
  try {
    const auto header = io::read_safetensors_header(path.string());
    if (!header.metadata.count("kiln.checkpoint")) return "not a kiln training checkpoint";
    io::load_safetensors(path.string());  // every byte: a truncated file fails here
    return {};
  } catch (const std::exception& e) {
    const std::string what = e.what();
    if (what.find("run past the end") != std::string::npos || what.find("runs past the end") != std::string::npos)
      return "truncated: " + what;
    return what;
  }
}

int evaluate_command(const fs::path& target, const std::string& split, int64_t max_batches, const std::string& which) {
  if (split != "test" && split != "train") throw ConfigError("--split expects test or train, got \"" + split + "\"");
  const fs::path ckpt = checkpoint_of(target, which);
  auto [config, task] = load_for_eval(ckpt);
  const EvalResult r = evaluate(task, config, split, max_batches);
  const auto header = io::read_safetensors_header(ckpt.string());
  const std::string step = header.metadata.count("step") ? header.metadata.at("step") : "?";
  std::printf("%s (step %s), %s split, %lld %s\n", ckpt.string().c_str(), step.c_str(), split.c_str(),
              static_cast<long long>(r.samples), task.gpt ? "tokens" : "samples");
  if (task.gpt)
    std::printf("loss %.4f  bits/char %.4f\n", r.loss, r.bits_per_char);
  else
    std::printf("loss %.4f  accuracy %.2f%%\n", r.loss, 100 * r.accuracy);
  return 0;
}

namespace {

// `kiln export --format onnx`: the model of `ckpt` through exporter::to_onnx,
// with an example input of the run's sample shape (token ids for the GPT).
int export_onnx(const fs::path& target, const fs::path& ckpt, const ExportOptions& o) {
  if (!o.dtype.empty() && o.dtype != "float32" && o.dtype != "fp32")
    throw ConfigError("--dtype " + o.dtype + " is for --format pytorch; ONNX files are written in float32");
  if (o.opset < 13 || o.opset > 17)
    throw ConfigError("--opset expects 13 to 17 (17 writes LayerNorm as one LayerNormalization node), got " +
                      std::to_string(o.opset));
  auto [config, task] = load_for_eval(ckpt);
  const auto header = io::read_safetensors_header(ckpt.string());
  const std::string step = header.metadata.count("step") ? header.metadata.at("step") : "?";
  std::vector<std::string> axes;
  const std::string dyn = o.dynamic.empty() ? (task.gpt ? "batch,seq" : "batch") : o.dynamic;
  if (dyn != "none") {
    size_t from = 0;
    while (from <= dyn.size()) {
      const size_t comma = std::min(dyn.find(',', from), dyn.size());
      axes.push_back(dyn.substr(from, comma - from));
      from = comma + 1;
    }
  }
  std::map<int64_t, std::string> dynamic;
  for (const std::string& a : axes) {
    if (a == "batch")
      dynamic[0] = "batch";
    else if (a == "seq" && task.gpt)
      dynamic[1] = "seq";
    else
      throw ConfigError("--dynamic expects batch" + std::string(task.gpt ? ", seq" : "") +
                        " or none (comma-separated), got \"" + a + "\"" +
                        (a == "seq" ? " (seq is the language model's sequence axis; this model has none)" : ""));
  }
  Tensor example;
  if (task.gpt) {
    example = zeros({1, task.gpt->options.block_size}, TensorOptions(kInt64));
  } else {
    std::vector<int64_t> shape{1};
    shape.insert(shape.end(), task.sample_shape.begin(), task.sample_shape.end());
    example = zeros(shape, TensorOptions(kFloat32));
  }
  fs::path out = o.out;
  if (out.empty())
    out = fs::is_directory(target) ? target / "model.onnx" : ckpt.parent_path() / (ckpt.stem().string() + ".onnx");
  exporter::Graph graph =
      exporter::capture(*task.model, {example}, {.dynamic_axes = {{"input", dynamic}}, .opset = o.opset});
  // --optimize: the standard passes only, so the file stays plain ONNX; what
  // kiln's own runtime would fuse on top (infer::optimize) is reported beside.
  std::optional<exporter::StandardReport> folded;
  int64_t kiln_nodes = 0;
  exporter::FuseReport fused;
  if (o.optimize) {
    folded = exporter::optimize_standard(graph);
    exporter::Graph for_kiln = graph;
    fused = exporter::fuse_for_kiln(for_kiln);
    kiln_nodes = static_cast<int64_t>(for_kiln.nodes.size());
  }
  exporter::ExternalDataOptions external;
  if (o.external_data) external.mode = exporter::ExternalDataOptions::Mode::kAlways;
  const auto r = exporter::write_onnx(graph, out.string(), o.opset,
                                      "kiln model of " + ckpt.string() + " (step " + step + ")", external);
  std::string ops;
  for (const auto& [op, n] : r.op_counts) ops += (ops.empty() ? "" : ", ") + op + " " + std::to_string(n);
  std::string in = "[";
  for (int64_t i = 0; i < example.dim(); ++i)
    in += (i ? ", " : "") + (dynamic.count(i) ? dynamic.at(i) : std::to_string(example.size(i)));
  in += "]";
  std::printf("wrote %s: the model of %s (step %s) as ONNX, opset %lld\n", out.string().c_str(), ckpt.string().c_str(),
              step.c_str(), static_cast<long long>(o.opset));
  std::printf(
      "  input \"input\" %s %s, output \"output\"; %lld nodes (%s); %lld initializers, %lld parameters, "
      "%lld bytes\n",
      task.gpt ? "int64 token ids" : "float32", in.c_str(), static_cast<long long>(r.nodes), ops.c_str(),
      static_cast<long long>(r.initializers), static_cast<long long>(r.parameters), static_cast<long long>(r.bytes));
  if (!r.data_path.empty())
    std::printf("  %lld initializers as external data in %s (%lld bytes); keep it beside the model\n",
                static_cast<long long>(r.external_initializers), r.data_path.c_str(),
                static_cast<long long>(r.data_bytes));
  if (folded) {
    const exporter::FoldReport& f = folded->fold;
    std::string linear;
    if (f.into_linear > 0) linear = ", " + std::to_string(f.into_linear) + " into their Linear layers";
    std::printf("  optimised: %lld BatchNorms folded into their convolutions%s, %lld nodes -> %lld",
                static_cast<long long>(f.folded - f.into_linear), linear.c_str(),
                static_cast<long long>(folded->nodes_before), static_cast<long long>(folded->nodes_after));
    if (folded->identities_removed > 0)
      std::printf(" (%lld Identity/Dropout removed)", static_cast<long long>(folded->identities_removed));
    std::printf(
        "; standard ONNX\n  kiln's own runtime (infer::optimize) fuses it further to %lld nodes: %lld "
        "kiln.FusedConv, %lld kiln.FusedGemm (bias, residual add, ReLU/GELU inside), %lld kiln.Attention\n",
        static_cast<long long>(kiln_nodes), static_cast<long long>(fused.fused_conv),
        static_cast<long long>(fused.fused_gemm), static_cast<long long>(fused.attention));
  }
  if (!o.check) {
    std::printf(r.data_path.empty()
                    ? "run it with ONNX Runtime, OpenCV DNN or any ONNX runtime (docs/export.md)\n"
                    : "run it with ONNX Runtime or another runtime that reads external data (OpenCV 4.6 DNN does "
                      "not; docs/export.md)\n");
    return 0;
  }
  // The check's input: a batch of 2 where the batch is free, random values
  // (token ids) from a fixed seed, so a rerun checks the same numbers.
  manual_seed(0);
  std::vector<int64_t> shape(example.sizes().begin(), example.sizes().end());
  if (dynamic.count(0)) shape[0] = 2;
  const Tensor x = task.gpt ? randint(0, task.gpt->options.vocab_size, shape, TensorOptions(kInt64)) : randn(shape);
  std::string dims;
  for (size_t i = 0; i < shape.size(); ++i) dims += (i ? ", " : "") + std::to_string(shape[i]);
  std::printf("check: ONNX Runtime beside kiln on an input [%s], node by node\n", dims.c_str());
  fs::path json = out;
  json.replace_extension(".check.json");
  const exporter::NodeCheckReport report = check_export(*task.model, graph, x, o.opset, 1e-4, json);
  std::fputs(report.str().c_str(), stdout);
  std::printf("wrote %s: the same report as JSON\n", json.string().c_str());
  return report.first_divergent ? 1 : 0;
}

}  // namespace

int export_command(const fs::path& target, const ExportOptions& o) {
  if (o.format == "onnx") return export_onnx(target, checkpoint_of(target, o.checkpoint), o);
  if (o.format != "pytorch")
    throw ConfigError(
        "--format expects onnx (an ONNX model for inference runtimes) or pytorch (a state dict with "
        "PyTorch's names, as safetensors), got \"" +
        o.format + "\"");
  if (!o.dynamic.empty() || o.opset != 17 || o.check || o.optimize || o.external_data)
    throw ConfigError("--dynamic, --opset, --optimize, --check and --external-data are for --format onnx");
  std::optional<DType> dtype;
  if (o.dtype == "bfloat16" || o.dtype == "bf16")
    dtype = kBFloat16;
  else if (o.dtype == "float16" || o.dtype == "fp16")
    dtype = kFloat16;
  else if (o.dtype != "float32" && o.dtype != "fp32" && !o.dtype.empty())
    throw ConfigError("--dtype expects float32, bfloat16 or float16, got \"" + o.dtype + "\"");
  const fs::path ckpt = checkpoint_of(target, o.checkpoint);
  auto [config, task] = load_for_eval(ckpt);
  const auto header = io::read_safetensors_header(ckpt.string());
  const std::string step = header.metadata.count("step") ? header.metadata.at("step") : "?";
  fs::path out = o.out;
  if (out.empty())
    out = fs::is_directory(target) ? target / "model.safetensors"
                                   : ckpt.parent_path() / (ckpt.stem().string() + ".pytorch.safetensors");
  nn::PyTorchExportOptions eo{.dtype = dtype};
  eo.metadata = {{"kiln.step", step}, {"kiln.config", config.to_toml()}, {"kiln.source_checkpoint", ckpt.string()}};
  const io::NamedTensors dict = nn::pytorch_state_dict(*task.model, eo);
  nn::save_pytorch_weights(*task.model, out.string(), eo);
  int64_t params = 0;
  for (const auto& [name, p] : task.model->named_parameters()) params += p.numel();
  std::printf("wrote %s: %zu tensors (%lld parameters), the model of %s (step %s) with PyTorch's state_dict names\n",
              out.string().c_str(), dict.size(), static_cast<long long>(params), ckpt.string().c_str(), step.c_str());
  std::printf("load it into the same architecture in PyTorch with load_state_dict(strict=True) (docs/interop.md)\n");
  return 0;
}

int sample_command(const fs::path& target, const SampleOptions& o) {
  if (o.tokens < 0) throw ConfigError("--tokens expects a count >= 0, got " + std::to_string(o.tokens));
  if (o.temperature < 0) throw ConfigError("--temperature expects a value >= 0, got " + std::to_string(o.temperature));
  auto [config, task] = load_for_eval(checkpoint_of(target));
  if (!task.gpt)
    throw ConfigError(target.string() +
                      ": `kiln sample` needs a language model (model.type = \"gpt\"), this run has \"" +
                      config.string("model.type") + "\"");
  std::vector<int64_t> ids;
  for (unsigned char ch : o.prompt) ids.push_back(ch);
  if (ids.empty()) ids.push_back('\n');
  std::fwrite(o.prompt.data(), 1, o.prompt.size(), stdout);
  const auto t0 = std::chrono::steady_clock::now();
  models::generate(*task.gpt, ids,
                   {.max_new_tokens = o.tokens,
                    .temperature = o.temperature,
                    .top_k = o.top_k,
                    .seed = o.seed,
                    .use_kv_cache = o.kv_cache},
                   [](int64_t next) {
                     std::fputc(static_cast<int>(next), stdout);
                     std::fflush(stdout);
                   });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("\n");
  if (o.timing)
    std::fprintf(stderr, "%lld tokens in %.3f s: %.1f tokens/s (kv cache %s)\n", static_cast<long long>(o.tokens), s,
                 s > 0 ? static_cast<double>(o.tokens) / s : 0.0, o.kv_cache ? "on" : "off");
  return 0;
}

namespace {

void inspect_file(const fs::path& path) {
  const auto header = io::read_safetensors_header(path.string());
  const auto file = io::load_safetensors(path.string());
  const bool ckpt = header.metadata.count("kiln.checkpoint") > 0;
  std::printf("%s: %s, %zu tensors, %s of data\n", path.string().c_str(),
              ckpt ? "kiln training checkpoint" : "safetensors file", file.tensors.size(),
              format_bytes(static_cast<int64_t>(header.data_size)).c_str());
  std::printf("%-48s %-9s %-18s %10s %12s %12s %12s %12s\n", "name", "dtype", "shape", "bytes", "min", "max", "mean",
              "std");
  int64_t params = 0;
  for (const auto& [name, t] : file.tensors) {
    std::string shape = "[";
    for (int64_t i = 0; i < t.dim(); ++i) shape += (i ? ", " : "") + std::to_string(t.size(i));
    shape += "]";
    if (name.rfind("model.", 0) == 0) params += t.numel();
    const auto bytes = static_cast<long long>(t.numel() * static_cast<int64_t>(t.element_size()));
    std::printf("%-48s %-9s %-18s %10lld", name.c_str(), std::string(dtype_name(t.dtype())).c_str(), shape.c_str(),
                bytes);
    if (t.numel() > 0 && t.dtype() != kBool) {
      Tensor d = t.to(kFloat64).contiguous();
      const double* x = d.data_ptr<double>();
      const auto n = static_cast<size_t>(d.numel());
      double mn = x[0], mx = x[0], sum = 0;
      for (size_t i = 0; i < n; ++i) {
        mn = std::min(mn, x[i]);
        mx = std::max(mx, x[i]);
        sum += x[i];
      }
      const double mean = sum / static_cast<double>(n);
      double var = 0;
      for (size_t i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
      std::printf(" %12.4g %12.4g %12.4g %12.4g", mn, mx, mean,
                  n > 1 ? std::sqrt(var / static_cast<double>(n - 1)) : 0.0);
    }
    std::printf("\n");
  }
  if (ckpt) std::printf("model parameters: %lld\n", static_cast<long long>(params));
  std::printf("metadata (%zu keys):\n", header.metadata.size());
  for (const auto& [k, v] : header.metadata) {
    if (k == "config") continue;
    std::string shown = v;
    std::replace(shown.begin(), shown.end(), '\n', ' ');
    if (shown.size() > 100) shown = shown.substr(0, 97) + "...";
    std::printf("  %s = %s\n", k.c_str(), shown.c_str());
  }
  if (header.metadata.count("config")) std::printf("config:\n%s", header.metadata.at("config").c_str());
}

void inspect_run(const fs::path& dir) {
  std::ifstream in(dir / "summary.json");
  if (in) {
    json s = json::parse(in, nullptr, false);
    if (s.is_discarded()) throw ConfigError((dir / "summary.json").string() + ": not valid JSON");
    std::printf("run %s: %s\n", dir.string().c_str(), s.value("name", std::string("?")).c_str());
    std::printf("  status   %s at step %lld of %lld\n", s.value("status", std::string("?")).c_str(),
                static_cast<long long>(s.value("steps", int64_t{0})),
                static_cast<long long>(s.value("total_steps", int64_t{0})));
    std::printf("  config   %s\n", s.value("config_path", std::string("?")).c_str());
    std::printf("  wall     %s\n", format_duration(s.value("wall_s", 0.0)).c_str());
    if (s.contains("final"))
      for (const auto& [k, v] : s["final"].items()) std::printf("  %-16s %s\n", k.c_str(), v.dump().c_str());
  } else {
    std::printf("run %s: no summary.json yet (the run is in progress or was killed)\n", dir.string().c_str());
  }
  int64_t lines = 0;
  std::string last;
  std::ifstream m(dir / "metrics.jsonl");
  for (std::string line; std::getline(m, line);)
    if (!line.empty()) ++lines, last = line;
  std::printf("  metrics  %lld lines in metrics.jsonl%s%s\n", static_cast<long long>(lines), lines ? ", last: " : "",
              last.c_str());
  if (fs::is_directory(dir / "checkpoints")) {
    train::CheckpointManager mgr(dir / "checkpoints");
    const auto list = mgr.list();
    std::printf("  checkpoints (%zu):", list.size());
    std::vector<std::string> bad;
    for (const auto& p : list) {
      const std::string why = checkpoint_problem(p);
      std::printf(" %s%s", p.filename().string().c_str(), why.empty() ? "" : " (UNUSABLE)");
      if (!why.empty()) bad.push_back(p.filename().string() + ": " + why);
    }
    std::printf("\n");
    for (const auto& b : bad) std::printf("  unusable %s\n", b.c_str());
  }
  if (fs::exists(dir / "report.html")) std::printf("  report   %s\n", (dir / "report.html").string().c_str());
}

}  // namespace

int inspect_command(const fs::path& target) {
  if (fs::is_directory(target)) {
    inspect_run(target);
    return 0;
  }
  if (!fs::exists(target)) throw ConfigError(target.string() + ": no such file or run directory");
  inspect_file(target);
  return 0;
}

}  // namespace kiln::cli
