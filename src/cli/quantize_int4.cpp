// `kiln quantize --method int4` (src/cli/quantize_int4.h).
#include "cli/quantize_int4.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <unordered_set>

#include "cli/commands.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/core/threads.h"
#include "kiln/data/loader.h"
#include "kiln/quant/int4.h"
#include "kiln/quant/int8_dynamic.h"

namespace kiln::cli {
namespace fs = std::filesystem;

namespace {

// Bytes of a module's tensors, a tensor shared under two names (GPT's tied head) once.
int64_t model_bytes(const nn::Module& m) {
  std::unordered_set<const void*> seen;
  int64_t b = 0;
  for (const auto& [name, t] : m.state_dict())
    if (t.defined() && seen.insert(t.data_ptr()).second) b += t.nbytes();
  return b;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int quantize_int4_command(const QuantizeOptions& o) {
  if (o.group_size < 2 || o.group_size % 2 != 0) throw ConfigError("--group-size expects an even number >= 2");
  if (o.gptq && o.calib_batches < 1) throw ConfigError("--calib-batches expects at least 1");
  if (o.bench_batch < 1 || o.bench_iters < 1) throw ConfigError("--bench-batch and --bench-iters expect at least 1");
  const fs::path ckpt = checkpoint_of(o.target, o.checkpoint);
  auto [config, task] = load_for_eval(ckpt);
  if (!task.gpt)
    throw ConfigError(ckpt.string() + ": --method int4 quantizes a GPT run's linears; this run's model is not a GPT");
  {
    const models::GPTOptions& g = task.gpt->options;
    const int64_t d_ff = g.d_ff > 0 ? g.d_ff : 4 * g.n_embd;
    if (g.n_embd % o.group_size != 0 || d_ff % o.group_size != 0)
      throw ConfigError("--group-size " + std::to_string(o.group_size) +
                        ": expected a divisor of the linears' inputs (n_embd " + std::to_string(g.n_embd) + ", d_ff " +
                        std::to_string(d_ff) + "), got one that is not");
  }
  auto [config_f, task_f] = load_for_eval(ckpt);  // the float model, kept for the timing and the reload

  const EvalResult before = evaluate(task, config, "test", o.eval_batches);
  std::printf("float32: validation %.4f bits/char (loss %.4f, %lld tokens)\n", before.bits_per_char, before.loss,
              static_cast<long long>(before.samples));
  const int64_t float_model_bytes = model_bytes(*task.model);

  const auto t0 = std::chrono::steady_clock::now();
  std::unique_ptr<quant::HessianRecorder> recorder;
  int64_t calib_tokens = 0;
  if (o.gptq) {
    recorder = std::make_unique<quant::HessianRecorder>(*task.model, quant::gpt_int4_targets());
    data::DataLoader<> loader(task.train_set,
                              {.batch_size = config.integer("data.batch_size"), .shuffle = true, .seed = 0});
    const NoGradGuard no_grad;
    int64_t n = 0;
    for (auto& batch : loader) {
      if (n++ >= o.calib_batches) break;
      (*task.model)(batch.data);
      calib_tokens += batch.data.numel();
    }
  }
  const double calib_s = seconds_since(t0);
  const auto t1 = std::chrono::steady_clock::now();
  const quant::Int4Report report = quant::quantize_linears_int4(*task.model, quant::gpt_int4_targets(),
                                                                {.group_size = o.group_size}, recorder.get());
  recorder.reset();
  const double quant_s = seconds_since(t1);
  const std::string method = o.gptq ? "GPTQ" : "round-to-nearest";
  std::printf(
      "\nint4 weight-only, %s, group size %lld: %zu linears (lm_head is tied to the token embedding and "
      "stays float)\n",
      method.c_str(), static_cast<long long>(o.group_size), report.paths.size());
  if (o.gptq)
    std::printf("  calibration: %lld batches, %lld tokens, %.2f s; GPTQ %.2f s\n",
                static_cast<long long>(o.calib_batches), static_cast<long long>(calib_tokens), calib_s, quant_s);
  else
    std::printf("  quantization %.2f s\n", quant_s);
  const int64_t int4_model_bytes = model_bytes(*task.model);
  std::printf("  weight bytes of the quantized linears: float32 %lld, int4 %lld (%.2f bits/weight, 1/%.2f)\n",
              static_cast<long long>(report.float_bytes), static_cast<long long>(report.int4_bytes),
              32.0 * static_cast<double>(report.int4_bytes) / static_cast<double>(report.float_bytes),
              static_cast<double>(report.float_bytes) / static_cast<double>(report.int4_bytes));
  std::printf("  whole model: float32 %lld bytes, int4 %lld bytes (1/%.2f)\n",
              static_cast<long long>(float_model_bytes), static_cast<long long>(int4_model_bytes),
              static_cast<double>(float_model_bytes) / static_cast<double>(int4_model_bytes));

  const EvalResult after = evaluate(task, config, "test", o.eval_batches);
  std::printf("int4:    validation %.4f bits/char (loss %.4f), %+.4f bits/char\n", after.bits_per_char, after.loss,
              after.bits_per_char - before.bits_per_char);

  print_forward_timing(task_f, task, o, "int4");

  const fs::path out = o.out.empty() ? (fs::is_directory(o.target) ? o.target / "model.int4.safetensors"
                                                                   : ckpt.parent_path() / "model.int4.safetensors")
                                     : fs::path(o.out);
  quant::save_int4(*task.model, out.string(),
                   {{"method", o.gptq ? "gptq" : "rtn"},
                    {"kiln.int4.group_size", std::to_string(o.group_size)},
                    {"source", ckpt.string()}});
  std::printf("wrote %s\n", out.string().c_str());

  // The file read back into the float model, as a user would: the same loss, or the file is wrong.
  quant::load_int4(*task_f.model, out.string());
  const EvalResult reloaded = evaluate(task_f, config_f, "test", o.eval_batches);
  const bool same = reloaded.loss == after.loss;
  std::printf("reloaded %s into a float model: %.4f bits/char%s\n", out.filename().string().c_str(),
              reloaded.bits_per_char, same ? ", as the int4 model" : ", DIFFERENT from the int4 model");
  if (!same) throw ValueError("kiln quantize: " + out.string() + " does not reload into the model that wrote it");
  return 0;
}

int quantize_gpt_int8_command(const QuantizeOptions& o) {
  if (o.bench_batch < 1 || o.bench_iters < 1) throw ConfigError("--bench-batch and --bench-iters expect at least 1");
  const fs::path ckpt = checkpoint_of(o.target, o.checkpoint);
  auto [config, task] = load_for_eval(ckpt);
  if (!task.gpt)
    throw ConfigError(ckpt.string() +
                      ": --method int8-dynamic quantizes a GPT run's linears; this run's model is not a GPT");
  auto [config_f, task_f] = load_for_eval(ckpt);
  const EvalResult before = evaluate(task, config, "test", o.eval_batches);
  std::printf("float32: validation %.4f bits/char (loss %.4f, %lld tokens)\n", before.bits_per_char, before.loss,
              static_cast<long long>(before.samples));
  const auto paths = quant::quantize_linears_int8_dynamic(*task.model, quant::gpt_int4_targets());
  std::printf(
      "\nint8 weights (per channel), uint8 activations quantized per token at run time: %zu linears "
      "(lm_head is tied to the token embedding and stays float)\n",
      paths.size());
  const EvalResult after = evaluate(task, config, "test", o.eval_batches);
  std::printf("int8:    validation %.4f bits/char (loss %.4f), %+.4f bits/char\n", after.bits_per_char, after.loss,
              after.bits_per_char - before.bits_per_char);
  print_forward_timing(task_f, task, o, "int8");
  return 0;
}

}  // namespace kiln::cli
