#pragma once
// `kiln plan`: will it fit? Bytes per rank by category for a zoo config or a
// transformer given by its dimensions, under a parallel layout, against a
// device's memory, with the dominant category and the cheapest single change
// that would make it fit (docs/memory.md, "Planning memory: kiln plan"). The
// arithmetic is cli/plan_model.h; this file reads the flags and the config,
// traces zoo models, and prints.
#include <string>
#include <vector>

namespace kiln::cli {

/// The flags as given (strings, so that an error can quote the value); empty: the default.
struct PlanOptions {
  std::string config;             // a zoo config (TOML); empty when the model is given by its dimensions
  std::vector<std::string> sets;  // --set overrides of the config
  std::string params, layers, d_model, heads, vocab, seq;
  std::string dp, zero, tp, pp, micro_batches, batch;
  std::string precision, optimizer, checkpointing;
  std::string device_mem = "80GiB";
  bool json = false;
};

/// Prints the plan (a table, or JSON with --json); 0 when it fits, 3 when it does
/// not. ConfigError (exit status 2) on a bad flag, naming the flag and its value.
int plan_command(const PlanOptions& options);

}  // namespace kiln::cli
