// kiln_bench_infer: the inference rows of scripts/bench.sh (issue 21's
// figures): one model and input per workload, timed as kiln's eager eval
// forward (InferenceMode) and as infer::optimize's model, and written as an
// ONNX file plus raw input for ONNX Runtime (bench/infer/ort_bench.js) to time
// on exactly the same model and input.
//
//   kiln_bench_infer --workload cnn[,resnet,gpt_infer] --dir DIR [--threads N] [--warmup 10] [--steps 50]
//                    [--profile on]
//   kiln_bench_infer --nodes on   node counts of every zoo model (default sizes):
//                                 captured, after --optimize's standard passes, after infer::optimize
//
// Per workload it writes DIR/NAME.onnx, DIR/NAME.input.bin (raw float32 or
// int64, C order), DIR/NAME.kiln.bin (the eager output, float32) and prints
// one JSON line per variant ("kiln_eager", "kiln_optimised") with every timed
// batch's milliseconds, the optimised graph's node counts and its largest
// difference from eager relative to the output's scale. The models and inputs
// are the training workloads' (bench/workloads: synthetic weights and data):
// cnn batch 64 of 1x28x28, resnet batch 32 of 3x32x32, gpt_infer one sequence
// of 128 tokens.
//
// cnn_int8 and resnet_int8 (batch 64 each): the float model timed eager and
// optimised ("kiln_eager", "kiln_optimised"), then quantized to int8 (PTQ,
// minmax, four synthetic calibration batches; ResNet's BatchNorms folded
// first), written as ONNX in QDQ form, and timed as the eager int8 model
// ("kiln_int8_eager") and as kiln's runtime on the QDQ graph
// ("kiln_int8_runtime", each QDQ pattern fused into an int8 kernel); the int8
// eager output is what ONNX Runtime's int8 run is compared with.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "../workloads/workloads.h"
#include "kiln/export/infer.h"
#include "kiln/export/onnx.h"
#include "kiln/export/optimize.h"
#include "kiln/export/runtime.h"
#include "kiln/kiln.h"
#include "kiln/profiler/profiler.h"
#include "kiln/quant/int4.h"
#include "kiln/quant/int8_dynamic.h"
#include "kiln/quant/ptq.h"

namespace {

using kiln::Tensor;
using Clock = std::chrono::steady_clock;

struct Args {
  std::vector<std::string> workloads;
  std::string dir;
  int threads = 0;
  int warmup = 10;
  int steps = 50;
  bool profile = false;
  bool nodes = false;
};

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "kiln_bench_infer: " << why
            << "\nusage: kiln_bench_infer --workload cnn[,resnet,gpt_infer] --dir DIR [--threads N] [--warmup N] "
               "[--steps N]\n";
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") usage("help");
    if (i + 1 >= argc) usage(flag + " needs a value");
    const std::string v = argv[++i];
    auto positive = [&](int min) {
      char* end = nullptr;
      const long x = std::strtol(v.c_str(), &end, 10);
      if (end == v.c_str() || *end != '\0' || x < min)
        usage(flag + " expects an integer >= " + std::to_string(min) + ", got '" + v + "'");
      return static_cast<int>(x);
    };
    if (flag == "--workload") {
      std::stringstream ss(v);
      for (std::string w; std::getline(ss, w, ',');)
        if (!w.empty()) a.workloads.push_back(w);
    } else if (flag == "--dir") {
      a.dir = v;
    } else if (flag == "--threads") {
      a.threads = positive(1);
    } else if (flag == "--warmup") {
      a.warmup = positive(1);
    } else if (flag == "--steps") {
      a.steps = positive(1);
    } else if (flag == "--nodes") {
      a.nodes = v == "1" || v == "on";
    } else if (flag == "--profile") {
      a.profile = v == "1" || v == "on";
    } else {
      usage("unknown flag " + flag);
    }
  }
  if (!a.nodes && (a.workloads.empty() || a.dir.empty())) usage("--workload and --dir are required");
  return a;
}

struct Model {
  std::shared_ptr<kiln::nn::Module> module;
  Tensor input;
};

Model make(const std::string& name) {
  using namespace kiln;
  Model m;
  if (name == "cnn" || name == "cnn_int8") {
    m.module = std::make_shared<models::CNN>();
    m.input = kiln_bench::synthetic_uniform("input", {64, 1, 28, 28}, 1.0);
  } else if (name == "resnet" || name == "resnet_int8") {
    m.module = std::make_shared<models::ResNet>();
    m.input = kiln_bench::synthetic_uniform("input", {name == "resnet" ? 32 : 64, 3, 32, 32}, 1.0);
  } else if (name == "mlp") {
    m.module = std::make_shared<models::MLP>();
    m.input = kiln_bench::synthetic_uniform("input", {8, 784}, 1.0);
  } else if (name == "vit") {
    m.module = std::make_shared<models::ViT>();
    m.input = kiln_bench::synthetic_uniform("input", {8, 1, 28, 28}, 1.0);
  } else if (name == "gpt_infer" || name == "gpt_infer_int8") {
    auto gpt = std::make_shared<models::GPT>();
    m.input = kiln_bench::synthetic_classes("input", {1, 128}, gpt->options.vocab_size);
    m.module = gpt;
  } else {
    usage("unknown workload '" + name + "'; expected cnn, resnet, gpt_infer, cnn_int8 or resnet_int8");
  }
  kiln_bench::synthetic_init(*m.module);
  m.module->eval();
  return m;
}

void write_raw(const std::string& path, const Tensor& t) {
  const Tensor c = t.contiguous();
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.numel() * c.element_size()));
  if (!f) throw kiln::IOError("kiln_bench_infer: cannot write " + path);
}

std::string num(double x) {
  if (!std::isfinite(x)) return "null";
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.9g", x);
  return buf;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double scaled_diff(const Tensor& got, const Tensor& want) {
  const kiln::NoGradGuard no_grad;
  const double scale = want.abs().max().item<float>();
  return (got - want).abs().max().item<float>() / std::max(scale, 1e-30);
}

template <typename F>
std::vector<double> time_batches(const Args& a, F&& f) {
  for (int i = 0; i < a.warmup; ++i) f();
  std::vector<double> ms;
  for (int i = 0; i < a.steps; ++i) {
    const auto t0 = Clock::now();
    f();
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  return ms;
}

void print(const std::string& workload, const std::string& variant, const Args& a, const std::vector<double>& ms,
           const std::string& extra) {
  std::ostringstream steps;
  for (size_t i = 0; i < ms.size(); ++i) steps << (i ? ", " : "") << num(ms[i]);
  std::printf(
      "{\"framework\": \"%s\", \"workload\": \"%s\", \"threads\": %d, \"warmup\": %d, \"steps\": %d, "
      "\"median_ms\": %s%s, \"step_ms\": [%s]}\n",
      variant.c_str(), workload.c_str(), kiln::get_num_threads(), a.warmup, a.steps, num(median(ms)).c_str(),
      extra.c_str(), steps.str().c_str());
  std::fflush(stdout);
}

// --profile on: the optimised graph run node by node with the Session's own
// kernels, each node timed; milliseconds per op type (medians over the timed
// batches) on stderr: where the time goes.
void profile(const kiln::infer::InferenceModel& opt, const Tensor& input, const Args& a) {
  namespace ex = kiln::exporter;
  const ex::Graph& g = opt.graph();
  const ex::SessionOptions fused = kiln::infer::fused_kernels();
  std::vector<ex::Kernel> kernels;
  for (const ex::Node& n : g.nodes) {
    auto it = fused.kernels.find(n.op_type);
    kernels.push_back(it != fused.kernels.end() ? it->second(n, g) : ex::builtin_kernel(n.op_type)(n, g));
  }
  std::map<std::string, std::vector<double>> per_op;  // op -> ms per batch
  const kiln::InferenceModeGuard inference;
  for (int step = 0; step < a.warmup + a.steps; ++step) {
    std::map<std::string, Tensor> values{{g.inputs[0].name, input}};
    for (const auto& [name, t] : g.initializers) values[name] = t;
    std::map<std::string, double> ms;
    for (size_t i = 0; i < g.nodes.size(); ++i) {
      std::vector<Tensor> in;
      for (const std::string& v : g.nodes[i].inputs) in.push_back(v.empty() ? Tensor() : values.at(v));
      const auto t0 = Clock::now();
      std::vector<Tensor> out = kernels[i](in);
      ms[g.nodes[i].op_type] += std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      for (size_t k = 0; k < out.size() && k < g.nodes[i].outputs.size(); ++k) values[g.nodes[i].outputs[k]] = out[k];
    }
    if (step >= a.warmup)
      for (const auto& [op, t] : ms) per_op[op].push_back(t);
  }
  const auto counts = g.op_counts();
  for (const auto& [op, v] : per_op)
    std::fprintf(stderr, "  %-16s x%-3lld %8.3f ms\n", op.c_str(), static_cast<long long>(counts.at(op)), median(v));
}

void run(const std::string& name, const Args& a) {
  Model m = make(name);
  const std::string base = a.dir + "/" + name;
  kiln::exporter::to_onnx(*m.module, {m.input}, base + ".onnx", {.dynamic_axes = {{"input", {{0, "batch"}}}}});
  write_raw(base + ".input.bin", m.input);
  Tensor want;
  {
    const kiln::InferenceModeGuard inference;
    want = (*m.module)(m.input);
  }
  write_raw(base + ".kiln.bin", want);
  const std::vector<double> eager = time_batches(a, [&] {
    const kiln::InferenceModeGuard inference;
    Tensor y = (*m.module)(m.input);
  });
  print(name, "kiln_eager", a, eager, "");

  const auto t0 = Clock::now();
  const kiln::infer::InferenceModel opt = kiln::infer::optimize(*m.module, {m.input});
  const double build_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  const double diff = scaled_diff(opt.forward(m.input), want);
  const std::vector<double> fast = time_batches(a, [&] { Tensor y = opt.forward(m.input); });
  const auto& r = opt.report();
  std::string extra = ", \"nodes_before\": " + std::to_string(r.nodes_before) +
                      ", \"nodes_after\": " + std::to_string(r.nodes_after) +
                      ", \"max_rel_diff_vs_eager\": " + num(diff) + ", \"optimize_ms\": " + num(build_ms);
  print(name, "kiln_optimised", a, fast, extra);
  if (a.profile) {
    std::fprintf(stderr, "%s, optimised graph, per op type (median ms per batch):\n", name.c_str());
    profile(opt, m.input, a);
  }
}

// --profile on: kiln's profiler over `steps` more batches of f; its op table on stderr.
template <typename F>
void profile_ops(const std::string& what, const Args& a, F&& f) {
  kiln::profiler::Options po;
  po.record_shapes = po.profile_memory = false;
  kiln::profiler::Profiler prof(po);
  prof.start();
  for (int i = 0; i < a.steps; ++i) f();
  prof.stop();
  std::fprintf(stderr, "%s, %d batches:\n%s\n", what.c_str(), a.steps, prof.table().c_str());
}

// The *_int8 workloads (see the header comment).
void run_int8(const std::string& name, const Args& a) {
  Model m = make(name);
  const std::string base = a.dir + "/" + name;
  print(name, "kiln_eager", a,
        time_batches(a,
                     [&] {
                       const kiln::InferenceModeGuard inference;
                       Tensor y = (*m.module)(m.input);
                     }),
        "");
  {
    const kiln::infer::InferenceModel opt = kiln::infer::optimize(*m.module, {m.input});
    print(name, "kiln_optimised", a, time_batches(a, [&] { Tensor y = opt.forward(m.input); }), "");
  }
  auto prepared = kiln::quant::prepare(*m.module, {.observer = "minmax", .fuse_bn = name == "resnet_int8"});
  {
    const kiln::NoGradGuard no_grad;
    for (int i = 0; i < 4; ++i)
      (*m.module)(kiln_bench::synthetic_uniform("calibration" + std::to_string(i), m.input.sizes(), 1.0));
  }
  kiln::quant::convert(*m.module, *prepared);
  const kiln::exporter::Graph g =
      kiln::exporter::capture(*m.module, {m.input}, {.dynamic_axes = {{"input", {{0, "batch"}}}}});
  kiln::exporter::write_onnx(g, base + ".onnx", 17);
  write_raw(base + ".input.bin", m.input);
  Tensor want;
  {
    const kiln::InferenceModeGuard inference;
    want = (*m.module)(m.input);
  }
  write_raw(base + ".kiln.bin", want);
  print(name, "kiln_int8_eager", a,
        time_batches(a,
                     [&] {
                       const kiln::InferenceModeGuard inference;
                       Tensor y = (*m.module)(m.input);
                     }),
        "");
  const kiln::exporter::Session session(g);
  const double diff = scaled_diff(session.run({m.input})[0], want);
  const auto ops = g.op_counts();
  std::string extra =
      ", \"quantize_linear\": " + std::to_string(ops.count("QuantizeLinear") ? ops.at("QuantizeLinear") : 0) +
      ", \"max_rel_diff_vs_eager\": " + num(diff);
  print(name, "kiln_int8_runtime", a, time_batches(a, [&] { Tensor y = session.run({m.input})[0]; }), extra);
  if (a.profile) profile_ops(name + ", int8 runtime", a, [&] { Tensor y = session.run({m.input})[0]; });
}

// gpt_infer_int8: the gpt_infer model and sequence timed as float32 eager and
// optimised, then with every block's linears (c_attn, c_proj, c_fc) swapped
// for quant::DynamicInt8Linear (per-token activation scales, no calibration;
// the tied lm_head stays float), timed eager. Its output's largest difference
// from float relative to the output's scale is printed, not judged here.
void run_gpt_int8(const std::string& name, const Args& a) {
  Model m = make(name);
  auto eager = [&] {
    const kiln::InferenceModeGuard inference;
    return (*m.module)(m.input);
  };
  const Tensor want = eager();
  print(name, "kiln_eager", a, time_batches(a, [&] { Tensor y = eager(); }), "");
  {
    const kiln::infer::InferenceModel opt = kiln::infer::optimize(*m.module, {m.input});
    print(name, "kiln_optimised", a, time_batches(a, [&] { Tensor y = opt.forward(m.input); }), "");
  }
  const auto paths = kiln::quant::quantize_linears_int8_dynamic(*m.module, kiln::quant::gpt_int4_targets());
  const double diff = scaled_diff(eager(), want);
  const std::string extra =
      ", \"int8_linears\": " + std::to_string(paths.size()) + ", \"max_rel_diff_vs_float\": " + num(diff);
  print(name, "kiln_int8_eager", a, time_batches(a, [&] { Tensor y = eager(); }), extra);
  if (a.profile) profile_ops(name + ", int8 eager", a, [&] { Tensor y = eager(); });
}

void node_counts() {
  namespace ex = kiln::exporter;
  for (const std::string name : {"mlp", "cnn", "resnet", "vit", "gpt_infer"}) {
    Model m = make(name);
    const bool tokens = m.input.dtype() == kiln::kInt64;
    ex::CaptureOptions co;
    co.dynamic_axes["input"][0] = "batch";
    if (tokens) co.dynamic_axes["input"][1] = "seq";
    ex::Graph g = ex::capture(*m.module, {m.input}, co);
    const size_t captured = g.nodes.size();
    const ex::StandardReport s = ex::optimize_standard(g);
    const kiln::infer::InferenceModel opt = kiln::infer::optimize(*m.module, {m.input});
    std::printf(
        "{\"model\": \"%s\", \"captured\": %zu, \"standard\": %zu, \"batch_norms_folded\": %lld, "
        "\"kiln\": %lld, \"fused_conv\": %lld, \"fused_gemm\": %lld}\n",
        name == "gpt_infer" ? "gpt" : name.c_str(), captured, g.nodes.size(), static_cast<long long>(s.fold.folded),
        static_cast<long long>(opt.report().nodes_after), static_cast<long long>(opt.report().fused_conv),
        static_cast<long long>(opt.report().fused_gemm));
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  if (a.threads > 0) kiln::set_num_threads(a.threads);
  try {
    if (a.nodes) node_counts();
    for (const auto& name : a.workloads) {
      if (name == "gpt_infer_int8")
        run_gpt_int8(name, a);
      else if (name.size() > 5 && name.substr(name.size() - 5) == "_int8")
        run_int8(name, a);
      else
        run(name, a);
    }
  } catch (const kiln::Error& e) {
    std::cerr << "kiln_bench_infer: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
