// Argument parsing (CLI11) and the error boundary of the `kiln` command.
#include "cli/app.h"

#include <unistd.h>
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>

#include "cli/commands.h"
#include "cli/commbench.h"
#include "cli/config.h"
#include "cli/doctor.h"
#include "cli/int8_model.h"
#include "cli/plan.h"
#include "cli/profile_files.h"
#include "cli/prune.h"
#include "cli/quantize.h"
#include "cli/scenario.h"
#include "cli/train.h"
#include "kiln/core/error.h"
#include "kiln/dist/dist.h"
#include "kiln/dist/launch.h"

#ifndef KILN_VERSION
#define KILN_VERSION "unknown"
#endif

namespace kiln::cli {
namespace fs = std::filesystem;

namespace {

/// Under mpirun every rank runs `fn` in the world group; a rank that throws
/// ends the whole job (rather than leaving the others in a collective).
int run_maybe_distributed(const std::function<int(dist::ProcessGroupPtr)>& fn) {
  if (!dist::launched_by_mpi()) return fn(nullptr);
  dist::init();
  int rc = 0;
  dist::run_or_abort([&] { rc = fn(dist::world()); });
  return rc;
}

/// `kiln launch`: mpirun with kiln's environment; when the job fails, which rank died, where.
int launch_command(int nprocs, const std::string& hostfile, std::vector<std::string> command) {
  // `kiln` names this very executable, which need not be on PATH (build/release/bin/kiln).
  if (!command.empty() && command[0] == "kiln") {
    std::error_code ec;
    const fs::path self = fs::read_symlink("/proc/self/exe", ec);
    if (!ec) command[0] = self.string();
  }
  dist::LaunchResult r;
  try {
    r = dist::run_launch(nprocs, command, {.hostfile = hostfile});
  } catch (const ValueError& e) {
    throw ConfigError(e.what());  // a usage error: exit status 2
  }
  if (!r.report.empty()) std::fputs(r.report.c_str(), stderr);
  return r.exit_code;
}

int dispatch(int argc, char** argv) {
  CLI::App app{
      "kiln: train, resume, evaluate, export, sample and inspect deep-learning runs, and plan their memory "
      "(configs/*.toml, docs/config.md)",
      "kiln"};
  app.set_version_flag("--version", std::string("kiln ") + KILN_VERSION);
  app.require_subcommand(1);

  std::string config_path, out_dir, run_dir, target, split = "test";
  std::vector<std::string> sets;
  int64_t batches = 0;
  SampleOptions so;

  auto* train = app.add_subcommand("train", "Train the run a config describes into a run directory");
  train->add_option("config", config_path, "The run's config (TOML, see docs/config.md)")->required();
  train->add_option("--out", out_dir, "Run directory (default: runs/<config name>)");
  train->add_option("--set", sets, "Override a config key: --set optim.lr=3e-4 (repeatable)")->take_all();
  std::string profile_steps;
  train->add_option("--profile", profile_steps,
                    "Profile steps FIRST:END (FIRST to END-1, e.g. 20:25; FIRST alone: 5 steps) into RUN/profile/: "
                    "Chrome trace, op table, per-step breakdown ([profile] steps; docs/profiler_cli.md)");

  ResumeOptions ro;
  auto* resume = app.add_subcommand("resume", "Continue a run from its latest checkpoint, with the identical future");
  resume->add_option("run_dir", run_dir, "The run directory")->required();
  resume
      ->add_option("--set", ro.sets,
                   "Change a key from this step on, e.g. train.max_steps=2000 or optim.lr=1e-4 (repeatable; keys "
                   "that cannot change are refused: docs/config.md)")
      ->take_all();
  resume->add_flag("--allow-world-size-change", ro.allow_world_size_change,
                   "Continue on another number of processes than the run was trained on (a different future)");

  auto* eval = app.add_subcommand(
      "eval", "Loss and accuracy (or bits/char) of a run's latest checkpoint or of a checkpoint file");
  eval->add_option("target", target, "Run directory or checkpoint file")->required();
  eval->add_option("--split", split, "test (held out) or train")->capture_default_str();
  eval->add_option("--batches", batches, "Evaluate at most this many batches (0: all)")->capture_default_str();
  std::string which;
  eval->add_option("--checkpoint", which, "Of a run directory: latest (default), best (train.keep_best) or a step");
  std::string int8_file;
  eval->add_option("--int8", int8_file,
                   "Evaluate the int8 model `kiln quantize` wrote (default RUN/model.int8.safetensors, or FILE)")
      ->expected(0, 1);

  ExportOptions xo;
  auto* exp = app.add_subcommand(
      "export", "Write a run's model for deployment (--format onnx, the default) or for PyTorch (--format pytorch)");
  exp->add_option("target", target, "Run directory or checkpoint file")->required();
  exp->add_option("--format", xo.format,
                  "onnx: the inference graph and weights for ONNX Runtime, OpenCV DNN, ...; pytorch: a safetensors "
                  "state dict with PyTorch's names")
      ->capture_default_str();
  exp->add_option("--out", xo.out, "Output file (default: RUN/model.onnx, or RUN/model.safetensors for pytorch)");
  exp->add_option("--checkpoint", xo.checkpoint, "Of a run directory: latest (default), best or a step");
  exp->add_option("--int8", int8_file,
                  "onnx: the int8 model `kiln quantize` wrote (default RUN/model.int8.safetensors, or FILE) in QDQ "
                  "form (QuantizeLinear/DequantizeLinear, int8 weights); default --out RUN/model.int8.onnx")
      ->expected(0, 1);
  exp->add_option("--dtype", xo.dtype, "pytorch: float32 (default), bfloat16 or float16");
  exp->add_option("--dynamic", xo.dynamic,
                  "onnx: input axes left free, batch and (GPT) seq, comma-separated, or none (default: batch, and "
                  "seq for a GPT)");
  exp->add_option("--opset", xo.opset, "onnx: operator set, 13 to 17 (13: LayerNorm written out)")
      ->capture_default_str();
  exp->add_flag("--optimize", xo.optimize,
                "onnx: fold each BatchNorm into the Conv or Linear before it and drop Identity/Dropout (the file "
                "stays standard ONNX); prints node counts before/after");
  exp->add_flag("--external-data", xo.external_data,
                "onnx: weights of 1 KiB or more in a side file <out>.data (ONNX external data, 4096-byte aligned); "
                "without it only a model past protobuf's 2 GiB limit does that");
  exp->add_flag("--check", xo.check,
                "onnx: run the file in ONNX Runtime beside kiln and print each node's max abs / relative "
                "difference (against kiln's runtime, and at module outputs against kiln's module), naming the "
                "first that diverges (exit 1 then); the report also goes to <out>.check.json");

  auto* sample = app.add_subcommand("sample", "Text from a trained character-level GPT");
  sample->add_option("target", target, "Run directory or checkpoint file")->required();
  sample->add_option("--prompt", so.prompt, "Text to continue (empty: start after a newline)")->capture_default_str();
  sample->add_option("--tokens", so.tokens, "Bytes to generate")->capture_default_str();
  sample->add_option("--temperature", so.temperature, "Softmax temperature (0: greedy)")->capture_default_str();
  sample->add_option("--top-k", so.top_k, "Sample among the k most likely bytes (0: all)")->capture_default_str();
  sample->add_option("--seed", so.seed, "Sampling seed (same seed, same text)")->capture_default_str();
  sample->add_flag("--no-kv-cache{false}", so.kv_cache,
                   "Recompute the whole context for every byte instead of caching keys and values (same text)");
  sample->add_flag("--timing", so.timing, "Print the generation's tokens/s to stderr");

  auto* inspect = app.add_subcommand("inspect", "Show a safetensors file, a checkpoint or a run directory");
  inspect->add_option("target", target, "File or run directory")->required();

  PlanOptions po;
  auto* plan =
      app.add_subcommand("plan",
                         "Will it fit? Bytes per rank by category for a config or a model size under a parallel layout "
                         "(docs/memory.md)");
  plan->add_option("config", po.config, "A zoo config (TOML); or give the model by --params / --layers ...");
  plan->add_option("--set", po.sets, "Override a config key (repeatable)")->take_all();
  plan->add_option("--params", po.params, "Parameter count, e.g. 7e9");
  plan->add_option("--layers", po.layers, "Transformer layers");
  plan->add_option("--d-model", po.d_model, "Hidden size");
  plan->add_option("--heads", po.heads, "Attention heads");
  plan->add_option("--vocab", po.vocab, "Vocabulary size");
  plan->add_option("--seq", po.seq, "Sequence length");
  plan->add_option("--dp", po.dp, "Data-parallel ranks (default 1)");
  plan->add_option("--zero", po.zero, "ZeRO stage 0|1|2|3 (default 0)");
  plan->add_option("--tp", po.tp, "Tensor-parallel ranks (default 1)");
  plan->add_option("--pp", po.pp, "Pipeline stages (default 1)");
  plan->add_option("--micro-batches", po.micro_batches, "Micro-batches per step (default 1)");
  plan->add_option("--batch", po.batch, "Samples per data-parallel replica per step (default: the config's, or 1)");
  plan->add_option("--precision", po.precision, "fp32|bf16|fp16 (default: the config's amp, or bf16)");
  plan->add_option("--optimizer", po.optimizer, "sgd|momentum|adam|adamw (default: the config's, or adam)");
  plan->add_option("--checkpointing", po.checkpointing, "none|blocks (default none)");
  plan->add_option("--device-mem", po.device_mem, "Device memory: 80GiB, 80GB, 1.5TiB ...")->capture_default_str();
  plan->add_flag("--json", po.json, "Print JSON instead of the table");

  int nprocs = 0;
  std::string hostfile;
  std::vector<std::string> command;
  auto* launch = app.add_subcommand(
      "launch",
      "Run a command on N processes through mpirun: kiln launch -n 2 -- kiln train CONFIG (docs/distributed.md)");
  launch->add_option("-n,--nprocs", nprocs, "Number of processes (ranks), >= 1")->required();
  launch->add_option("--hostfile", hostfile, "Open MPI hostfile for a multi-machine job (lines: HOST slots=N)");
  launch->add_option("command", command, "The command every rank runs, after --")->required();

  CommbenchOptions cbo;
  auto* commbench = app.add_subcommand(
      "commbench",
      "Time and bandwidth of the collectives over message sizes, as nccl-tests: kiln launch -n 4 -- kiln commbench "
      "(docs/distributed.md)");
  commbench->add_option("--ops", cbo.ops, "Comma-separated: allreduce, reduce_scatter, allgather, alltoall, broadcast")
      ->capture_default_str();
  commbench->add_option("--min-bytes", cbo.min_bytes, "Smallest message (8, 64K, 1M: K/M/G are powers of 1024)")
      ->capture_default_str();
  commbench->add_option("--max-bytes", cbo.max_bytes, "Largest message; sizes double from --min-bytes up to it")
      ->capture_default_str();
  commbench->add_option("--iters", cbo.iters, "Timed calls per size")->capture_default_str();
  commbench->add_option("--warmup", cbo.warmup, "Untimed calls per size first")->capture_default_str();
  commbench
      ->add_option("--algorithm", cbo.algorithm,
                   "Open MPI's algorithm: default | ring | recursive_doubling | ... (every collective that has it) | "
                   "op=name,op=name")
      ->capture_default_str();
  commbench->add_option("--json", cbo.json, "Also write the results to this file (rank 0)");
  commbench
      ->add_option("--wire", cbo.wire,
                   "float32 | bf16 | fp16: allreduce's float32 buffers sent as 16 bits (DDP's compression hooks; "
                   "with --ops allreduce)")
      ->capture_default_str();

  bool doctor_json = false;
  auto* doctor = app.add_subcommand(
      "doctor",
      "What went wrong in a run, or is going wrong: findings by severity, with evidence and the usual fix "
      "(docs/diagnostics.md)");
  doctor->add_option("run_dir", run_dir, "The run directory")->required();
  doctor->add_flag("--json", doctor_json, "Print the findings as JSON");

  std::string scenario_action, scenario_name, scenario_dir, scenario_out;
  auto* scenario = app.add_subcommand(
      "scenario",
      "The anomaly gallery: kiln scenario list; kiln scenario run NAME reproduces a classic training "
      "failure and shows what kiln says (docs/diagnostics.md)");
  scenario->add_option("action", scenario_action, "list or run (rank: one rank of a data-parallel scenario)")
      ->required();
  scenario->add_option("name", scenario_name, "The scenario to run");
  scenario->add_option("--dir", scenario_dir, "The config scenarios' directory (default: examples/scenarios)");
  scenario->add_option("--out", scenario_out, "Where a scenario writes its run (default: a temporary directory)");

  std::string profile_sort = "self";
  int64_t profile_top = 20;
  auto* profile = app.add_subcommand(
      "profile", "Print a profiled run's op table and per-step breakdown again (from RUN/profile/, no re-run)");
  profile->add_option("run_dir", run_dir, "The run directory (trained with --profile)")->required();
  profile->add_option("--sort", profile_sort, "Order the ops by self, total, calls or flops")->capture_default_str();
  profile->add_option("--top", profile_top, "Rows to print (0: all)")->capture_default_str();

  QuantizeOptions quantize_options;
  auto* quantize = add_quantize_command(app, quantize_options);
  PruneOptions prune_options;
  auto* prune = add_prune_command(app, prune_options);

  if (argc <= 1) {  // `kiln` alone: what it can do, as `kiln --help` prints it
    std::fputs(app.help().c_str(), stdout);
    return 0;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    // `kiln launch -n 2 kiln train CONFIG --out DIR`: without `--`, launch takes the command's options as its own.
    bool launch_without_dashes = argc > 1 && std::string(argv[1]) == "launch";
    for (int i = 2; i < argc; ++i) launch_without_dashes = launch_without_dashes && std::string(argv[i]) != "--";
    if (launch_without_dashes && dynamic_cast<const CLI::ExtrasError*>(&e)) {
      std::fprintf(stderr,
                   "kiln: error: kiln launch: %s; put `--` between launch's options and the command, e.g. "
                   "kiln launch -n 2 -- kiln train CONFIG --out DIR\n",
                   e.what());
      return 2;
    }
    std::fprintf(stderr, "kiln: error: %s (see kiln --help, or kiln COMMAND --help)\n", e.what());
    return 2;
  }
  if (train->parsed()) {
    // --profile is [profile] steps, quoted: "20:25" is not a TOML value by itself.
    if (!profile_steps.empty()) sets.push_back("profile.steps=\"" + profile_steps + "\"");
    Config config = Config::from_file(config_path, sets);
    const fs::path dir = out_dir.empty() ? fs::path("runs") / config.name() : fs::path(out_dir);
    return run_maybe_distributed([&](dist::ProcessGroupPtr g) { return cli::train(config, dir, config_path, g); });
  }
  if (resume->parsed())
    return run_maybe_distributed([&](dist::ProcessGroupPtr g) { return cli::resume(run_dir, ro, g); });
  if (launch->parsed()) return launch_command(nprocs, hostfile, command);
  if (commbench->parsed()) return commbench_command(cbo);
  if (eval->parsed() && eval->count("--int8") > 0)
    return evaluate_int8_command(target, int8_file, split, batches, which);
  if (eval->parsed()) return evaluate_command(target, split, batches, which);
  if (exp->parsed() && exp->count("--int8") > 0) return export_int8_command(target, int8_file, xo);
  if (exp->parsed()) return export_command(target, xo);
  if (quantize->parsed()) return quantize_command(quantize_options);
  if (prune->parsed()) return prune_command(prune_options);
  if (sample->parsed()) return sample_command(target, so);
  if (plan->parsed()) return plan_command(po);
  if (doctor->parsed()) return doctor_command(run_dir, doctor_json);
  if (profile->parsed()) return profile_command(run_dir, profile_sort, profile_top);
  if (scenario->parsed() && scenario_action == "rank")
    return run_maybe_distributed([&](dist::ProcessGroupPtr g) { return scenario_rank(scenario_name, g); });
  if (scenario->parsed()) return scenario_command(scenario_action, scenario_name, scenario_dir, scenario_out);
  return inspect_command(target);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return dispatch(argc, argv);
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "kiln: error: %s\n", e.what());
    return 2;
  } catch (const kiln::Error& e) {
    std::fprintf(stderr, "kiln: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln: error: %s\n", e.what());
    return 1;
  }
}

}  // namespace kiln::cli
