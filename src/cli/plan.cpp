// `kiln plan` (cli/plan.h).
#include "cli/plan.h"

#include <cmath>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <tuple>

#include "cli/config.h"
#include "cli/plan_model.h"
#include "cli/task.h"
#include "kiln/core/allocator.h"
#include "kiln/core/format.h"
#include "kiln/optim/clip_grad.h"

namespace kiln::cli {

namespace {

using json = nlohmann::json;

[[noreturn]] void flag_error(const std::string& flag, const std::string& value, const std::string& expected) {
  throw ConfigError("kiln plan: " + flag + " " + (value.empty() ? "\"\"" : value) + ": expected " + expected);
}

int64_t int_flag(const std::string& flag, const std::string& value, int64_t fallback, int64_t lo) {
  if (value.empty()) return fallback;
  size_t pos = 0;
  long long v = 0;
  try {
    v = std::stoll(value, &pos);
  } catch (const std::exception&) {
    pos = 0;
  }
  if (pos == 0 || pos != value.size() || v < lo) flag_error(flag, value, "an integer >= " + std::to_string(lo));
  return v;
}

double count_flag(const std::string& flag, const std::string& value) {
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(value, &pos);
  } catch (const std::exception&) {
    pos = 0;
  }
  if (pos == 0 || pos != value.size() || !std::isfinite(v) || v <= 0)
    flag_error(flag, value, "a positive number (7e9, 1.3e8)");
  return v;
}

template <typename E>
E choice_flag(const std::string& flag, const std::string& value, const std::map<std::string, E>& choices,
              const std::string& listed) {
  const auto it = choices.find(value);
  if (it == choices.end()) flag_error(flag, value, "one of " + listed);
  return it->second;
}

PlanPrecision precision_of_amp(const std::string& amp) {
  return amp == "bf16" ? PlanPrecision::BF16 : amp == "fp16" ? PlanPrecision::FP16 : PlanPrecision::FP32;
}

const char* amp_of_precision(PlanPrecision p) {
  return p == PlanPrecision::BF16 ? "bf16" : p == PlanPrecision::FP16 ? "fp16" : "off";
}

/// One training step as `kiln train` takes it (forward under the config's autocast, backward with the
/// GradScaler for fp16, gradient-norm clipping, the optimizer step), taken twice at this micro-batch
/// and precision; the second step's category peaks are the trace (the first allocates the optimizer
/// state and the oneDNN primitives).
PlanTrace trace_step(const Config& base, PlanPrecision precision, int64_t micro_batch, bool checkpointing) {
  Config c = base;
  c.set_all({"data.batch_size=" + std::to_string(micro_batch),
             std::string("amp=\"") + amp_of_precision(precision) + "\"", "data.num_workers=0"});
  const std::string type = c.string("model.type");
  if (checkpointing && type != "gpt" && type != "vit" && type != "resnet")
    throw std::invalid_argument("--checkpointing blocks: this config's model (" + type +
                                ") has no blocks to checkpoint; kiln checkpoints gpt, vit and resnet");
  if (type == "gpt" || type == "vit" || type == "resnet")  // the key exists only for models with blocks
    c.set_all({std::string("train.activation_checkpointing=\"") + (checkpointing ? "blocks" : "none") + "\""});
  PlanTrace out;
  {
    Task t = build_task(c, Purpose::Train);
    auto params = t.model->parameters();
    auto it = t.train_loader->begin();
    const data::Example batch = *it;
    for (int step = 0; step < 2; ++step) {
      if (step == 1) memory::reset_peak_stats();
      t.optimizer->zero_grad();
      Tensor loss = batch_loss(t, batch);
      if (t.scaler) {
        t.scaler->scale(loss).backward();
        t.scaler->unscale_(*t.optimizer);
        optim::clip_grad_norm_(params, optim::kInfNorm);
        t.scaler->step(*t.optimizer);
        t.scaler->update();
      } else {
        loss.backward();
        optim::clip_grad_norm_(params, optim::kInfNorm);
        t.optimizer->step();
      }
    }
    const auto st = memory::stats();
    out.activation = static_cast<double>(st[MemoryCategory::Activation].peak_bytes);
    out.workspace = static_cast<double>(st[MemoryCategory::Workspace].peak_bytes);
    const double batch_bytes = static_cast<double>(memory::rounded_size(static_cast<size_t>(batch.data.nbytes())) +
                                                   memory::rounded_size(static_cast<size_t>(batch.target.nbytes())));
    // The loader holds the batch in use and the one being collated, plus num_workers × prefetch_factor (2) ahead.
    out.data = batch_bytes * static_cast<double>(2 + 2 * base.integer("data.num_workers"));
  }
  return out;
}

struct Described {
  PlanModel model;
  PlanLayout defaults;
  std::string what;  // "gpt_mobydick.toml: gpt, 818,432 parameters"
};

std::string with_commas(double v) {
  const std::string digits = std::to_string(static_cast<long long>(std::llround(v)));
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0 && digits[i - 1] != '-') out += ',';
    out += digits[i];
  }
  return out;
}

Described from_config(const PlanOptions& o) {
  auto config = std::make_shared<Config>(Config::from_file(o.config, o.sets));
  Described d;
  {
    Task t = build_task(*config, Purpose::Evaluate);
    double fp32 = 0;
    for (const Tensor& p : t.model->parameters())
      fp32 += static_cast<double>(memory::rounded_size(static_cast<size_t>(p.numel()) * 4));
    d.model.params = static_cast<double>(t.model->num_parameters());
    d.model.fp32_param_bytes = fp32;
  }
  d.model.autocast_weights = true;
  const std::string type = config->string("model.type");
  if (type == "gpt") {
    d.model.layers = config->integer("model.n_layer");
    d.model.d_model = config->integer("model.n_embd");
    d.model.heads = config->integer("model.n_head");
    d.model.vocab = 256;
    d.model.seq = config->integer("data.context");
  }
  auto cache = std::make_shared<std::map<std::tuple<int, int64_t, bool>, PlanTrace>>();
  d.model.trace = [config, cache](PlanPrecision p, int64_t b, bool checkpointing) {
    const auto key = std::make_tuple(static_cast<int>(p), b, checkpointing);
    auto it = cache->find(key);
    if (it == cache->end()) it = cache->emplace(key, trace_step(*config, p, b, checkpointing)).first;
    return it->second;
  };
  d.defaults.batch = config->integer("data.batch_size");
  if (type == "gpt" || type == "vit" || type == "resnet")
    d.defaults.checkpointing = config->string("train.activation_checkpointing") == "blocks";
  d.defaults.precision = precision_of_amp(config->string("amp"));
  const std::string opt = config->string("optim.name");
  const bool momentum = (opt == "sgd" || opt == "rmsprop") && config->number("optim.momentum") > 0;
  d.defaults.optimizer = opt == "adam"      ? PlanOptimizer::Adam
                         : opt == "adamw"   ? PlanOptimizer::AdamW
                         : opt == "rmsprop" ? (momentum ? PlanOptimizer::RMSpropMomentum : PlanOptimizer::RMSprop)
                         : momentum         ? PlanOptimizer::Momentum
                                            : PlanOptimizer::SGD;
  d.what = o.config + ": " + type + ", " + with_commas(d.model.params) + " parameters";
  return d;
}

Described from_dims(const PlanOptions& o) {
  Described d;
  const bool any_dim =
      !o.layers.empty() || !o.d_model.empty() || !o.heads.empty() || !o.vocab.empty() || !o.seq.empty();
  if (any_dim) {
    const std::pair<const char*, const std::string*> dims[] = {{"--layers", &o.layers},
                                                               {"--d-model", &o.d_model},
                                                               {"--heads", &o.heads},
                                                               {"--vocab", &o.vocab},
                                                               {"--seq", &o.seq}};
    std::string missing;
    for (const auto& [flag, v] : dims)
      if (v->empty()) missing += std::string(missing.empty() ? "" : ", ") + flag;
    if (!missing.empty())
      throw ConfigError(
          "kiln plan: a model given by its dimensions needs --layers, --d-model, --heads, --vocab and "
          "--seq; missing " +
          missing);
    d.model.layers = int_flag("--layers", o.layers, 0, 1);
    d.model.d_model = int_flag("--d-model", o.d_model, 0, 1);
    d.model.heads = int_flag("--heads", o.heads, 0, 1);
    d.model.vocab = int_flag("--vocab", o.vocab, 0, 1);
    d.model.seq = int_flag("--seq", o.seq, 0, 1);
    if (d.model.d_model % d.model.heads != 0)
      throw ConfigError("kiln plan: --heads " + o.heads + ": must divide --d-model " + o.d_model);
    d.model.params = gpt_param_count(d.model.layers, d.model.d_model, d.model.vocab, d.model.seq);
  }
  if (!o.params.empty()) d.model.params = count_flag("--params", o.params);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3g parameters", d.model.params);
  d.what = buf;
  if (any_dim)
    d.what += " (" + std::to_string(d.model.layers) + " layers, d_model " + std::to_string(d.model.d_model) + ", " +
              std::to_string(d.model.heads) + " heads, vocab " + std::to_string(d.model.vocab) + ", seq " +
              std::to_string(d.model.seq) + ")";
  return d;
}

std::string decimal_gb(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GB", bytes / 1e9);
  return buf;
}

std::string layout_text(const PlanLayout& l) {
  return "dp " + std::to_string(l.dp) + " (ZeRO-" + std::to_string(l.zero) + "), tp " + std::to_string(l.tp) + ", pp " +
         std::to_string(l.pp) + ", batch " + std::to_string(l.batch) + " in " + std::to_string(l.micro_batches) +
         " micro-batch" + (l.micro_batches > 1 ? "es" : "") + ", " + plan_precision_name(l.precision) + ", " +
         plan_optimizer_name(l.optimizer) + ", checkpointing " + (l.checkpointing ? "blocks" : "none");
}

json layout_json(const PlanLayout& l) {
  return {{"dp", l.dp},
          {"zero", l.zero},
          {"tp", l.tp},
          {"pp", l.pp},
          {"micro_batches", l.micro_batches},
          {"batch", l.batch},
          {"precision", plan_precision_name(l.precision)},
          {"optimizer", plan_optimizer_name(l.optimizer)},
          {"checkpointing", l.checkpointing ? "blocks" : "none"}};
}

}  // namespace

int plan_command(const PlanOptions& o) {
  const bool dims = !o.params.empty() || !o.layers.empty() || !o.d_model.empty() || !o.heads.empty() ||
                    !o.vocab.empty() || !o.seq.empty();
  if (o.config.empty() && !dims)
    throw ConfigError(
        "kiln plan: no model: give a config (kiln plan configs/gpt_mobydick.toml), --params N, or --layers, "
        "--d-model, --heads, --vocab and --seq");
  if (!o.config.empty() && dims)
    throw ConfigError("kiln plan: give either a config (" + o.config +
                      ") or the model's size (--params / --layers ...), not both");
  if (o.config.empty() && !o.sets.empty()) throw ConfigError("kiln plan: --set applies to a config only");

  // Flags first, so that a typo is reported before a config is built.
  PlanLayout l;
  l.dp = int_flag("--dp", o.dp, 1, 1);
  l.zero = int_flag("--zero", o.zero, 0, 0);
  if (l.zero > 3) flag_error("--zero", o.zero, "0, 1, 2 or 3");
  l.tp = int_flag("--tp", o.tp, 1, 1);
  l.pp = int_flag("--pp", o.pp, 1, 1);
  l.micro_batches = int_flag("--micro-batches", o.micro_batches, 1, 1);
  const std::map<std::string, PlanPrecision> precisions = {
      {"fp32", PlanPrecision::FP32}, {"bf16", PlanPrecision::BF16}, {"fp16", PlanPrecision::FP16}};
  const std::map<std::string, PlanOptimizer> optimizers = {{"sgd", PlanOptimizer::SGD},
                                                           {"momentum", PlanOptimizer::Momentum},
                                                           {"adam", PlanOptimizer::Adam},
                                                           {"adamw", PlanOptimizer::AdamW}};
  std::optional<PlanPrecision> precision;
  if (!o.precision.empty()) precision = choice_flag("--precision", o.precision, precisions, "fp32, bf16, fp16");
  std::optional<PlanOptimizer> optimizer;
  if (!o.optimizer.empty())
    optimizer = choice_flag("--optimizer", o.optimizer, optimizers, "sgd, momentum, adam, adamw");
  if (!o.checkpointing.empty() && o.checkpointing != "none" && o.checkpointing != "blocks")
    flag_error("--checkpointing", o.checkpointing, "none or blocks");
  l.checkpointing = o.checkpointing == "blocks";
  const auto device = parse_byte_size(o.device_mem);
  if (!device) flag_error("--device-mem", o.device_mem, "a size such as 80GiB, 80GB, 1.5TiB or 512MiB");
  if (l.zero > 0 && l.dp == 1 && !o.zero.empty())
    flag_error("--zero", o.zero, "--dp > 1 (ZeRO shards across data-parallel ranks)");

  Described d = o.config.empty() ? from_dims(o) : from_config(o);
  if (o.checkpointing.empty()) l.checkpointing = d.defaults.checkpointing;  // a config's own policy
  l.batch = int_flag("--batch", o.batch, o.config.empty() ? 1 : d.defaults.batch, 1);
  l.precision = precision.value_or(o.config.empty() ? PlanPrecision::BF16 : d.defaults.precision);
  l.optimizer = optimizer.value_or(o.config.empty() ? PlanOptimizer::Adam : d.defaults.optimizer);

  PlanResult r;
  std::vector<PlanLever> levers;
  try {
    r = plan_memory(d.model, l);
    if (r.total > *device) levers = plan_levers(d.model, l, *device);
  } catch (const std::invalid_argument& e) {
    throw ConfigError(std::string("kiln plan: ") + e.what());
  }
  const bool fits = r.total <= *device;
  const PlanLever* fix = nullptr;
  for (const auto& lv : levers)
    if (lv.fits) {
      fix = &lv;
      break;
    }

  if (o.json) {
    json j;
    j["model"] = {{"source", o.config.empty() ? "dimensions" : o.config},
                  {"params", d.model.params},
                  {"layers", d.model.layers},
                  {"d_model", d.model.d_model},
                  {"heads", d.model.heads},
                  {"vocab", d.model.vocab},
                  {"seq", d.model.seq}};
    j["layout"] = layout_json(l);
    j["categories"] = json::array();
    for (const auto& row : r.rows)
      j["categories"].push_back(
          {{"name", row.category}, {"bytes", row.bytes}, {"formula", row.formula}, {"model_state", row.model_state}});
    j["model_states_bytes"] = r.model_states;
    j["total_bytes"] = r.total;
    j["device_mem_bytes"] = *device;
    j["fits"] = fits;
    j["dominant"] = r.dominant;
    j["suggestion"] =
        fix ? json{{"lever", fix->name}, {"change", fix->change}, {"total_bytes", fix->total}} : json(nullptr);
    j["levers"] = json::array();
    for (const auto& lv : levers)
      j["levers"].push_back({{"lever", lv.name}, {"change", lv.change}, {"total_bytes", lv.total}, {"fits", lv.fits}});
    std::printf("%s\n", j.dump(2).c_str());
    return fits ? 0 : 3;
  }

  std::printf("kiln plan: %s\nlayout: %s\n\n", d.what.c_str(), layout_text(l).c_str());
  std::printf("%-18s %12s %12s  %s\n", "per rank", "bytes", "GB (1e9)", "how");
  for (const auto& row : r.rows)
    std::printf("%-18s %12s %12s  %s\n", row.category.c_str(), format_bytes(row.bytes).c_str(),
                decimal_gb(row.bytes).c_str(), row.formula.c_str());
  std::printf("%-18s %12s %12s  %s\n", "model states", format_bytes(r.model_states).c_str(),
              decimal_gb(r.model_states).c_str(), "parameters + gradients + optimizer state + master weights");
  std::printf("%-18s %12s %12s\n", "total", format_bytes(r.total).c_str(), decimal_gb(r.total).c_str());
  std::printf("\ndevice memory %s: %s (%.0f %% used); dominant: %s (%s)\n", format_bytes(*device).c_str(),
              fits ? "fits" : "does NOT fit", 100 * r.total / *device, r.dominant.c_str(),
              format_bytes(r.row(r.dominant).bytes).c_str());
  if (!fits) {
    if (fix)
      std::printf("cheapest change that fits: %s (total %s)\n", fix->change.c_str(), format_bytes(fix->total).c_str());
    else
      std::printf("no single change fits; combine several\n");
    for (const auto& lv : levers)
      std::printf("  %-26s %12s  %s\n", lv.change.c_str(), format_bytes(lv.total).c_str(),
                  lv.fits ? "fits" : "does not fit");
  }
  return fits ? 0 : 3;
}

}  // namespace kiln::cli
