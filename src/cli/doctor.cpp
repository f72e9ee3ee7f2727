// `kiln doctor` (cli/doctor.h). Each check reads the run's lines and adds its
// findings; thresholds are chosen so that a healthy run of every shipped config
// gives nothing above "info" (tests/cli/test_cli_doctor.cpp runs them).
#include "cli/doctor.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "cli/config.h"

namespace kiln::cli {
namespace fs = std::filesystem;
using json = nlohmann::json;

const char* severity_name(Severity s) {
  switch (s) {
    case Severity::Info: return "info";
    case Severity::Warning: return "warning";
    case Severity::Error: return "error";
  }
  return "?";
}

namespace {

std::string num(double v) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double mean(const std::vector<double>& v, size_t from, size_t to) {
  double s = 0;
  for (size_t i = from; i < to; ++i) s += v[i];
  return to > from ? s / static_cast<double>(to - from) : 0;
}

double get(const json& j, const char* key, double fallback = 0) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : fallback;
}

/// What the run left behind, read once.
struct Run {
  fs::path dir;
  std::optional<Config> config;
  json summary;
  std::vector<json> train, eval, health, warnings, nonfinite, starts;  // starts: "start" and "resume" lines
  std::vector<json> errors;                                            // what stopped a library user's loop
  std::vector<double> loss, lr, steps;                                 // of the train lines
  double lr_at(int64_t step) const {
    for (size_t i = 0; i < train.size(); ++i)
      if (static_cast<int64_t>(steps[i]) >= step) return lr[i];
    return lr.empty() ? 0 : lr.back();
  }
  int64_t num_classes() const {
    if (!eval.empty() && eval.back().contains("num_classes")) return eval.back()["num_classes"].get<int64_t>();
    if (!config) return 0;
    const std::string ds = config->string("data.dataset");
    if (ds == "mnist" || ds == "fashion_mnist") return 10;
    if (ds == "synthetic") return config->integer("data.num_classes");
    return 0;  // not known without the data
  }
  bool lm() const { return config && config->string("model.type") == "gpt"; }
};

Run read_run(const fs::path& dir) {
  Run r;
  r.dir = dir;
  const fs::path metrics = dir / "metrics.jsonl";
  if (!fs::is_regular_file(metrics))
    throw ConfigError(dir.string() + ": no metrics.jsonl (expected a run directory written by kiln train)");
  if (fs::is_regular_file(dir / "config.toml")) {
    try {
      r.config = Config::from_file(dir / "config.toml");
    } catch (const ConfigError&) {
      // A config this kiln cannot read: the checks that need it are skipped.
    }
  }
  if (std::ifstream in(dir / "summary.json"); in) {
    r.summary = json::parse(in, nullptr, false);
    if (r.summary.is_discarded()) r.summary = json();
  }
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    json j = json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.contains("kind")) continue;
    const std::string kind = j["kind"].get<std::string>();
    if (kind == "train") {
      r.loss.push_back(get(j, "loss", std::nan("")));
      r.lr.push_back(get(j, "lr"));
      r.steps.push_back(get(j, "step"));
      r.train.push_back(std::move(j));
    } else if (kind == "eval") {
      r.eval.push_back(std::move(j));
    } else if (kind == "health") {
      r.health.push_back(std::move(j));
    } else if (kind == "warning") {
      r.warnings.push_back(std::move(j));
    } else if (kind == "error") {
      r.errors.push_back(std::move(j));
    } else if (kind == "nonfinite") {
      r.nonfinite.push_back(std::move(j));
    } else if (kind == "start" || kind == "resume") {
      r.starts.push_back(std::move(j));
    }
  }
  return r;
}

using Findings = std::vector<Finding>;

void add(Findings& out, Severity s, std::string code, std::string title, std::string evidence, std::string fix,
         int64_t step = -1) {
  out.push_back({s, std::move(code), std::move(title), std::move(evidence), std::move(fix), step});
}

// ---- the checks ----

void check_nonfinite(const Run& r, Findings& out) {
  if (r.nonfinite.empty()) return;
  const json& n = r.nonfinite.front();
  const int64_t step = static_cast<int64_t>(get(n, "step"));
  std::string ev =
      "loss " + n.value("loss", std::string("NaN")) + " at step " + std::to_string(step) + ", lr " + num(get(n, "lr"));
  // The gradient norm on the way there: a climb says the run diverged first.
  if (!r.train.empty()) {
    const size_t k = r.train.size();
    ev += "; grad_norm " + num(get(r.train[k - std::min<size_t>(k, 5)], "grad_norm")) + " at step " +
          std::to_string(static_cast<int64_t>(r.steps[k - std::min<size_t>(k, 5)])) + " -> " +
          num(get(r.train.back(), "grad_norm")) + " at step " + std::to_string(static_cast<int64_t>(r.steps.back()));
  }
  add(out, Severity::Error, "nan",
      "the loss became non-finite at step " + std::to_string(step) + " and the run stopped", ev,
      "rerun with --set train.anomaly=true: kiln stops at the first op that makes a NaN/Inf and names its module; "
      "for a log(0) or 0/0 in the model, clamp the input (x.clamp_min(eps)); when the grad norm climbed first, lower "
      "optim.lr or set optim.grad_clip = 1.0",
      step);
}

void check_divergence_and_spikes(const Run& r, Findings& out) {
  const size_t n = r.loss.size();
  if (n < 8) return;
  // Divergence: the last quarter's mean is well above the best stretch and above where the run began.
  const size_t q = std::max<size_t>(2, n / 4);
  double best = INFINITY;
  size_t best_at = 0;
  for (size_t i = 0; i + q <= n; ++i) {
    const double m = mean(r.loss, i, i + q);
    if (m < best) best = m, best_at = i;
  }
  const double first = mean(r.loss, 0, q), last = mean(r.loss, n - q, n);
  if (std::isfinite(last) && last > 2 * best && last > first) {
    add(out, Severity::Error, "divergence", "the loss diverged: it went back up above where it started",
        "mean loss " + num(best) + " around step " + std::to_string(static_cast<int64_t>(r.steps[best_at])) + ", " +
            num(last) + " over the last " + std::to_string(q) + " logged steps (first " + num(first) + "); lr " +
            num(r.lr[n - 1]) + ", grad_norm " + num(get(r.train[n - 1], "grad_norm")) + " at step " +
            std::to_string(static_cast<int64_t>(r.steps[n - 1])),
        "lower optim.lr (by 3-10x), add warm-up (schedule.warmup_steps) or optim.grad_clip = 1.0",
        static_cast<int64_t>(r.steps[best_at]));
    return;
  }
  // Spikes: a logged loss more than 3x the median of the ten before it.
  std::vector<std::string> spikes;
  int64_t first_spike = -1;
  for (size_t i = 10; i < n; ++i) {
    const double med =
        median(std::vector<double>(r.loss.begin() + static_cast<long>(i - 10), r.loss.begin() + static_cast<long>(i)));
    if (std::isfinite(r.loss[i]) && med > 0 && r.loss[i] > 3 * med) {
      if (first_spike < 0) first_spike = static_cast<int64_t>(r.steps[i]);
      if (spikes.size() < 5)
        spikes.push_back("step " + std::to_string(static_cast<int64_t>(r.steps[i])) + ": loss " + num(r.loss[i]) +
                         " (median before " + num(med) + ", lr " + num(r.lr[i]) + ", grad_norm " +
                         num(get(r.train[i], "grad_norm")) + ")");
    }
  }
  if (spikes.empty()) return;
  std::string ev;
  for (const auto& s : spikes) ev += (ev.empty() ? "" : "; ") + s;
  add(out, Severity::Warning, "loss_spike", "the loss spiked " + std::to_string(spikes.size()) + " time(s)", ev,
      "lower optim.lr or set optim.grad_clip = 1.0; with Adam a larger optim.eps or lower beta2 damps spikes",
      first_spike);
}

void check_flat_loss(const Run& r, Findings& out) {
  const size_t n = r.loss.size();
  if (n < 10 || !r.nonfinite.empty()) return;
  const size_t k = std::max<size_t>(2, n / 10);
  const double first = mean(r.loss, 0, k), last = mean(r.loss, n - k, n);
  if (!std::isfinite(first) || !std::isfinite(last) || first <= 0) return;
  if ((first - last) / first >= 0.02) return;
  // Why: nothing trainable, parameters without gradients, or updates too small to matter.
  std::string why = "the learning rate or the updates are too small";
  std::string fix = "raise optim.lr (try 10x; Adam's usual range is 1e-4 to 3e-3, SGD's 1e-2 to 1e-1)";
  if (!r.health.empty()) {
    const json& h = r.health.back();
    const double trainable = get(h, "trainable"), missing = get(h, "no_grad_count");
    if (trainable == 0) {
      why = "no parameter is trainable (every parameter has requires_grad = false)";
      fix = "unfreeze the layers to train (p.requires_grad_(true)) or build the optimizer over them";
    } else if (missing >= trainable) {
      why = "no parameter received a gradient: the graph is cut between the loss and every parameter";
      fix = "find the .detach(), NoGradGuard or non-differentiable op between the model and the loss";
    }
  }
  add(out, Severity::Warning, "flat_loss", "the loss does not move: " + why,
      "mean loss " + num(first) + " over the first " + std::to_string(k) + " logged steps, " + num(last) +
          " over the last " + std::to_string(k) + " (step " + std::to_string(static_cast<int64_t>(r.steps.back())) +
          "), lr up to " + num(*std::max_element(r.lr.begin(), r.lr.end())),
      fix);
}

void check_no_grad(const Run& r, Findings& out) {
  if (r.health.empty()) return;
  // Parameters without a gradient in every health record (a parameter used only sometimes is fine).
  std::map<std::string, int> count;
  for (const json& h : r.health)
    for (const auto& name : h.value("no_grad", json::array())) ++count[name.get<std::string>()];
  std::vector<std::string> always;
  for (const auto& [name, c] : count)
    if (c == static_cast<int>(r.health.size())) always.push_back(name);
  const double total = get(r.health.back(), "no_grad_count");
  if (always.empty() || total == 0) return;
  std::string names;
  for (size_t i = 0; i < std::min<size_t>(always.size(), 8); ++i) names += (i ? ", " : "") + always[i];
  if (always.size() > 8) names += ", ...";
  add(out, Severity::Warning, "no_grad",
      std::to_string(static_cast<int64_t>(total)) + " of " +
          std::to_string(static_cast<int64_t>(get(r.health.back(), "trainable"))) +
          " trainable parameters never received a gradient",
      "in all " + std::to_string(r.health.size()) + " health records (steps " +
          std::to_string(static_cast<int64_t>(get(r.health.front(), "step"))) + " to " +
          std::to_string(static_cast<int64_t>(get(r.health.back(), "step"))) + "): " + names,
      "a .detach() (or NoGradGuard) cuts them off the loss, or their module is never called in forward; remove the "
      "cut, or drop the unused module so the optimizer does not carry it",
      static_cast<int64_t>(get(r.health.front(), "step")));
}

void check_gradient_depth(const Run& r, Findings& out) {
  if (r.health.empty()) return;
  const json& h = r.health.back();
  std::vector<std::pair<std::string, double>> g;
  for (const auto& b : h.value("blocks", json::array()))
    if (get(b, "grad_rms", -1) >= 0) g.emplace_back(b["name"].get<std::string>(), get(b, "grad_rms"));
  const int64_t step = static_cast<int64_t>(get(h, "step"));
  if (g.size() >= 3) {
    const double first = g.front().second, last = g.back().second;
    if (last > 0 && first / last < 1e-3) {
      add(out, Severity::Warning, "vanishing_gradients",
          "gradients vanish with depth: the first block gets " + num(first / last) + "x the last block's gradient",
          "gradient RMS at step " + std::to_string(step) + ": " + g.front().first + " " + num(first) + ", " +
              g[g.size() / 2].first + " " + num(g[g.size() / 2].second) + ", " + g.back().first + " " + num(last),
          "use ReLU/GELU instead of sigmoid/tanh, He (kaiming) initialisation, normalisation layers (BatchNorm, "
          "LayerNorm) or residual connections; fewer layers",
          step);
    } else if (first > 0 && last > 0 && first / last > 1e4) {
      add(out, Severity::Warning, "exploding_gradients",
          "gradients grow with depth: the first block gets " + num(first / last) + "x the last block's gradient",
          "gradient RMS at step " + std::to_string(step) + ": " + g.front().first + " " + num(first) + ", " +
              g.back().first + " " + num(last),
          "optim.grad_clip = 1.0, normalisation layers or residual connections, a smaller initialisation", step);
    }
  }
  const double gn = get(h, "grad_norm");
  if (gn > 1e4)
    add(out, Severity::Warning, "exploding_gradients",
        "the gradient norm is " + num(gn) + " at step " + std::to_string(step), "global gradient norm " + num(gn),
        "optim.grad_clip = 1.0 and a lower optim.lr", step);
}

/// zero_grad() forgotten: each step's gradient adds to the last, so the norm climbs step after step.
void check_grad_accumulation(const Run& r, Findings& out) {
  const size_t n = r.train.size();
  if (n < 8) return;
  size_t rising = 0;
  for (size_t i = 1; i < n; ++i) rising += get(r.train[i], "grad_norm") > get(r.train[i - 1], "grad_norm") ? 1 : 0;
  const double first = get(r.train.front(), "grad_norm"), last = get(r.train.back(), "grad_norm");
  if (first <= 0 || last < 5 * first || static_cast<double>(rising) < 0.8 * static_cast<double>(n - 1)) return;
  add(out, Severity::Warning, "grad_accumulation",
      "the gradient norm climbs step after step: gradients accumulate across steps (zero_grad() not called?)",
      "grad_norm " + num(first) + " at step " + std::to_string(static_cast<int64_t>(r.steps.front())) + " -> " +
          num(last) + " at step " + std::to_string(static_cast<int64_t>(r.steps.back())) + ", rising at " +
          std::to_string(rising) + " of " + std::to_string(n - 1) + " logged steps",
      "call optimizer.zero_grad() (or model.zero_grad()) before each backward, unless accumulating on purpose "
      "(then step and zero every k micro-batches)",
      static_cast<int64_t>(r.steps.front()));
}

/// The model's input far from mean 0 and standard deviation 1: raw pixels (0-255), an
/// unnormalised feature; the first layer's initialisation assumes unit scale.
void check_input_scale(const Run& r, Findings& out) {
  std::vector<double> means, stds;
  for (const json& h : r.health)
    if (h.contains("input") && h["input"].is_object()) {
      means.push_back(get(h["input"], "mean"));
      stds.push_back(get(h["input"], "std"));
    }
  if (means.empty()) return;
  const double m = median(means), s = median(stds);
  if (std::abs(m) <= 5 && s <= 10 && s >= 1e-2) return;
  add(out, Severity::Warning, "input_scale",
      "the model's inputs are far from the scale its first layer expects (mean ~0, std ~1)",
      "input mean " + num(m) + ", standard deviation " + num(s) + " (median over " + std::to_string(means.size()) +
          " health records)",
      "normalise the inputs: subtract the training set's mean and divide by its standard deviation (pixels: "
      "x / 255, then (x - mean) / std)");
}

void check_dead_units(const Run& r, Findings& out) {
  if (r.health.empty()) return;
  // Dead on the last two records (one bad batch is not a dead layer).
  const size_t k = r.health.size();
  std::map<std::string, double> min_dead;
  std::map<std::string, std::string> type;
  for (size_t i = k - std::min<size_t>(k, 2); i < k; ++i)
    for (const auto& d : r.health[i].value("dead", json::array())) {
      const std::string name = d["name"].get<std::string>();
      const double f = get(d, "fraction");
      min_dead[name] = min_dead.count(name) ? std::min(min_dead[name], f) : f;
      type[name] = d.value("type", std::string("ReLU"));
    }
  std::string ev;
  double worst = 0;
  for (const auto& [name, f] : min_dead)
    if (f >= 0.5) {
      ev += (ev.empty() ? "" : ", ") + name + " (" + type[name] + ") " + num(100 * f) + "% dead";
      worst = std::max(worst, f);
    }
  if (ev.empty()) return;
  add(out, Severity::Warning, "dead_relu", "dead units: up to " + num(100 * worst) + "% of a layer's units never fire",
      ev + " at step " + std::to_string(static_cast<int64_t>(get(r.health.back(), "step"))) +
          " (a unit is dead when it is inactive for every sample of the batch)",
      "lower optim.lr (a large update pushes biases negative for good), use LeakyReLU/GELU, He initialisation, or "
      "normalise the inputs",
      static_cast<int64_t>(get(r.health.back(), "step")));
}

// Note [Subnormal optimizer state] in cli/health_log.cpp: state values in the
// subnormals cost a microcode assist each time they are touched.
void check_subnormal_state(const Run& r, Findings& out) {
  constexpr double kShare = 0.01;  // of the state's values
  const json* at = nullptr;
  double share = 0;
  for (const auto& h : r.health) {
    const auto it = h.find("subnormal_state");
    if (it == h.end() || get(*it, "values") <= 0) continue;
    const double f = get(*it, "subnormal") / get(*it, "values");
    if (f > share) share = f, at = &h;
  }
  if (!at || share < kShare || (r.config && r.config->boolean("flush_denormal"))) return;
  const json& s = (*at)["subnormal_state"];
  const auto step = static_cast<int64_t>(get(*at, "step"));
  std::string ev = "at step " + std::to_string(step) + ", " + num(100 * share) + "% of the optimizer's " +
                   num(get(s, "values")) + " state values were subnormal (nonzero, below 1.18e-38 in float32)";
  std::string most;
  for (const auto& w : s.value("worst", json::array()))
    most += (most.empty() ? "" : ", ") + w.value("param", std::string("?")) + "'s " +
            w.value("state", std::string("?")) + " (" + num(get(w, "subnormal")) + " of " + num(get(w, "values")) + ")";
  if (!most.empty()) ev += "; the most in " + most;
  // Throughput before and after, when the run has enough steps to say.
  std::vector<double> speed;
  for (const auto& t : r.train)
    if (t.contains("samples_per_s")) speed.push_back(get(t, "samples_per_s"));
  if (speed.size() >= 8) {
    const size_t q = speed.size() / 4;
    const double first = median({speed.begin(), speed.begin() + static_cast<std::ptrdiff_t>(q)});
    const double last = median({speed.end() - static_cast<std::ptrdiff_t>(q), speed.end()});
    if (first > 0 && last < 0.9 * first)
      ev += "; samples/s fell from " + num(first) + " (first quarter of the steps) to " + num(last) + " (last quarter)";
  }
  add(out, Severity::Warning, "subnormal_state",
      "optimizer state in the subnormals: " + num(100 * share) +
          "% of it, where each operation runs tens of times slower on x86",
      ev,
      "set flush_denormal = true (torch.set_flush_denormal(True)): subnormal inputs and results then count as zero, "
      "which changes no value above 1.18e-38 (AdamW's step over subnormal moments ran 21x slower without it). "
      "Such moments belong to parameters whose gradient went to zero and stayed there (a ReLU unit that died, an "
      "embedding row no batch uses); the dead_relu and no_grad findings look at those",
      step);
}

void check_update_ratio(const Run& r, Findings& out) {
  if (r.health.empty() || r.lr.empty()) return;
  // Only where the lr is near its peak: a schedule's warm-up and tail shrink the updates on purpose.
  const double peak = *std::max_element(r.lr.begin(), r.lr.end());
  std::vector<double> per_record;
  std::map<std::string, std::vector<double>> per_module;
  for (const json& h : r.health) {
    const int64_t step = static_cast<int64_t>(get(h, "step"));
    if (peak <= 0 || r.lr_at(step) < 0.5 * peak) continue;
    std::vector<double> ratios;
    for (const auto& m : h.value("modules", json::array()))
      if (get(m, "weight_norm") > 0 && get(m, "grad_norm") > 0) {
        ratios.push_back(get(m, "update_ratio"));
        per_module[m["name"].get<std::string>()].push_back(get(m, "update_ratio"));
      }
    if (!ratios.empty()) per_record.push_back(median(ratios));
  }
  if (per_record.size() < 2) return;
  const double ratio = median(per_record);
  std::string worst;
  double worst_v = 0;
  const bool high = ratio >= 0.3;  // Adam moves each weight by ~lr: early GPT steps reach 0.1 when healthy
  for (const auto& [name, v] : per_module) {
    const double m = median(v);
    if (worst.empty() || (high ? m > worst_v : m < worst_v)) worst = name, worst_v = m;
  }
  const std::string ev = "median update-to-weight ratio ||dw||/||w|| " + num(ratio) + " over " +
                         std::to_string(per_record.size()) + " health records near the peak lr " + num(peak) +
                         (worst.empty() ? std::string() : "; " + worst + ": " + num(worst_v)) +
                         " (healthy runs sit near 1e-3)";
  if (high)
    add(out, Severity::Warning, "update_ratio_high", "updates are large next to the weights: the lr is likely too high",
        ev, "lower optim.lr by about " + num(ratio / 1e-3) + "x, or add warm-up");
  else if (ratio > 0 && ratio < 1e-5)
    add(out, Severity::Warning, "update_ratio_low", "updates are tiny next to the weights: the lr is likely too low",
        ev, "raise optim.lr (by about " + num(1e-3 / ratio) + "x to reach ~1e-3)");
}

void check_overfitting(const Run& r, Findings& out) {
  if (r.eval.size() < 3 || r.train.empty()) return;
  size_t best = 0;
  for (size_t i = 1; i < r.eval.size(); ++i)
    if (get(r.eval[i], "loss") < get(r.eval[best], "loss")) best = i;
  const double best_loss = get(r.eval[best], "loss"), last_loss = get(r.eval.back(), "loss");
  const int64_t best_step = static_cast<int64_t>(get(r.eval[best], "step"));
  const double train_then =
      r.loss[std::min(r.loss.size() - 1, static_cast<size_t>(std::lower_bound(r.steps.begin(), r.steps.end(),
                                                                              static_cast<double>(best_step)) -
                                                             r.steps.begin()))];
  const double train_now = mean(r.loss, r.loss.size() - std::min<size_t>(r.loss.size(), 3), r.loss.size());
  if (best + 1 < r.eval.size() && last_loss > 1.1 * best_loss && train_now < train_then)
    add(out, Severity::Warning, "overfitting", "overfitting: the eval loss rises while the train loss falls",
        "eval loss " + num(best_loss) + " at step " + std::to_string(best_step) + " -> " + num(last_loss) +
            " at step " + std::to_string(static_cast<int64_t>(get(r.eval.back(), "step"))) + "; train loss " +
            num(train_then) + " -> " + num(train_now),
        "keep the best checkpoint (train.keep_best = \"loss\") and stop earlier; more data or augmentation "
        "(data.random_crop, data.hflip), weight decay (optim.weight_decay) or dropout",
        best_step);
}

void check_chance(const Run& r, Findings& out) {
  // When the lr already explains it (divergence, spikes, dead units), say so rather than suspect the data.
  bool lr_explains = false;
  for (const auto& f : out)
    lr_explains = lr_explains || f.code == "divergence" || f.code == "loss_spike" || f.code == "nan" ||
                  f.code == "dead_relu" || f.code == "update_ratio_high" || f.code == "input_scale";
  const int64_t classes = r.num_classes();
  if (classes < 2 || r.eval.empty() || r.lm() || r.steps.empty() || r.steps.back() < 50) return;
  const json& e = r.eval.back();
  if (!e.contains("accuracy")) return;
  const double acc = get(e, "accuracy"), chance = 1.0 / static_cast<double>(classes);
  if (acc > 1.5 * chance) return;
  const double train_loss = mean(r.loss, r.loss.size() - std::min<size_t>(r.loss.size(), 5), r.loss.size());
  const bool memorising = train_loss < 0.5 * std::log(static_cast<double>(classes));
  add(out, Severity::Error, "chance_accuracy",
      "accuracy at chance: the model learned nothing that carries to the test set",
      "test accuracy " + num(100 * acc) + "% at step " + std::to_string(static_cast<int64_t>(get(e, "step"))) +
          " with " + std::to_string(classes) + " classes (chance " + num(100 * chance) + "%); train loss " +
          num(train_loss) + " (ln " + std::to_string(classes) + " = " + num(std::log(static_cast<double>(classes))) +
          (memorising ? ": the training set is being memorised" : ": the training set is not learned either") + ")",
      lr_explains  ? "the warnings below explain it (the lr, or the inputs' scale): fix those first"
      : memorising ? "labels do not belong to their inputs: check that inputs and labels are shuffled together and "
                     "read in the same order"
                   : "check that labels and inputs line up and that the inputs are normalised as the first layer "
                     "expects (mean ~0, std ~1); then check the lr",
      static_cast<int64_t>(get(e, "step")));
}

void check_schedule(const Run& r, Findings& out) {
  if (r.config) {
    const int64_t warmup = r.config->integer("schedule.warmup_steps");
    const int64_t total = r.summary.is_object() && r.summary.contains("total_steps")
                              ? r.summary["total_steps"].get<int64_t>()
                              : (r.starts.empty() ? 0 : static_cast<int64_t>(get(r.starts.front(), "total_steps")));
    if (total > 0 && warmup >= total)
      add(out, Severity::Warning, "warmup_too_long",
          "the warm-up is longer than the run: the lr never reaches optim.lr",
          "schedule.warmup_steps = " + std::to_string(warmup) + ", the run has " + std::to_string(total) +
              " steps; the lr peaked at " + num(r.lr.empty() ? 0 : *std::max_element(r.lr.begin(), r.lr.end())) +
              " of optim.lr " + num(r.config->number("optim.lr")),
          "make schedule.warmup_steps a few percent of train.steps (e.g. " +
              std::to_string(std::max<int64_t>(1, total / 20)) + ")");
    if (r.config->string("schedule.type") == "step" && r.lr.size() >= 4) {
      // A step schedule whose lr has fallen 100x within the first tenth of the run.
      const double lr0 = r.config->number("optim.lr");
      const int64_t total_steps = static_cast<int64_t>(r.steps.back());
      for (size_t i = 0; i < r.lr.size(); ++i)
        if (r.steps[i] <= 0.1 * static_cast<double>(total_steps) && lr0 > 0 && r.lr[i] < 1e-2 * lr0) {
          add(out, Severity::Warning, "schedule_too_fast",
              "the step schedule decays the lr 100x in the first tenth of the run: stepped per batch where per "
              "epoch was meant?",
              "lr " + num(r.lr[i]) + " at step " + std::to_string(static_cast<int64_t>(r.steps[i])) + " (optim.lr " +
                  num(lr0) + ", schedule.step_size = " + std::to_string(r.config->integer("schedule.step_size")) +
                  " steps, gamma " + num(r.config->number("schedule.gamma")) + ")",
              "schedule.step_size counts optimizer steps (batches), not epochs: multiply it by the batches per epoch",
              static_cast<int64_t>(r.steps[i]));
          break;
        }
    }
  }
  // An lr jump where a process resumed.
  for (const json& s : r.starts) {
    if (s["kind"] != "resume") continue;
    const double at = get(s, "step");
    size_t i = 0;
    while (i < r.steps.size() && r.steps[i] <= at) ++i;
    if (i == 0 || i >= r.steps.size()) continue;
    const double before = r.lr[i - 1], after = r.lr[i];
    if (before > 0 && (after > 3 * before || after < before / 3))
      add(out, Severity::Warning, "lr_jump_on_resume", "the lr jumped when the run resumed",
          "lr " + num(before) + " at step " + std::to_string(static_cast<int64_t>(r.steps[i - 1])) + " -> " +
              num(after) + " at step " + std::to_string(static_cast<int64_t>(r.steps[i])) + " (resumed at step " +
              std::to_string(static_cast<int64_t>(at)) + ")",
          "resume with the optimizer's and the scheduler's state, not the weights alone (kiln resume restores both; "
          "a hand-written loop saves and loads them with the model: train::CheckpointRefs{.model, .optimizer, "
          ".scheduler}, in PyTorch optimizer.state_dict() and scheduler.state_dict())",
          static_cast<int64_t>(at));
  }
}

void check_data_and_memory(const Run& r, Findings& out) {
  if (r.train.size() >= 3) {
    std::vector<double> wait;
    double waited_s = 0;                           // the time it cost: each window's share times its length
    for (size_t i = 1; i < r.train.size(); ++i) {  // the first line's window holds the start-up
      wait.push_back(get(r.train[i], "data_wait"));
      waited_s += wait.back() * std::max(0.0, get(r.train[i], "time_s") - get(r.train[i - 1], "time_s"));
    }
    const double w = median(wait);
    // A run over in a second (a tiny model whose steps take microseconds) is not worth the advice.
    if (w > 0.3 && waited_s >= 1.0)
      add(out, Severity::Warning, "data_stall",
          "the input pipeline is the bottleneck: the loop waits for data " + num(100 * w) + "% of the time",
          "median data_wait " + num(w) + " over " + std::to_string(wait.size()) + " train lines, " + num(waited_s) +
              " s waited in all" +
              (r.config ? "; data.num_workers = " + std::to_string(r.config->integer("data.num_workers"))
                        : std::string()),
          "raise data.num_workers, make per-sample transforms cheaper, or precompute them");
  }
  for (const json& w : r.warnings)
    if (w.value("what", "") == "memory_leak")
      add(out, Severity::Error, "memory_leak", "memory grows step after step", w.value("message", ""),
          "do not keep tensors that hold their graph across steps: accumulate loss.item() (or loss.detach()), not "
          "loss",
          static_cast<int64_t>(get(w, "step")));
}

/// An evaluation that ran with modules in training mode (the {"what":"eval_train_mode"} warnings an
/// EvalCheck wrote): BatchNorm folded the evaluation data into its running statistics, dropout was on.
void check_eval_mode(const Run& r, Findings& out) {
  std::vector<const json*> found;
  for (const json& w : r.warnings)
    if (w.value("what", "") == "eval_train_mode") found.push_back(&w);
  if (found.empty()) return;
  std::string steps;
  for (size_t i = 0; i < found.size() && i < 6; ++i)
    steps += (i ? ", " : "") + std::to_string(static_cast<int64_t>(get(*found[i], "step")));
  if (found.size() > 6) steps += ", ...";
  // The modules of the last such evaluation, with what that evaluation changed.
  const json& first = *found.front();
  const json& last = *found.back();
  std::string modules;
  bool bn = false, dropout = false;
  for (const auto& m : last.value("modules", json::array())) {
    std::string what;
    if (get(m, "p") > 0) {
      dropout = true;
      what = "dropout p=" + num(get(m, "p")) + " active in " +
             std::to_string(static_cast<int64_t>(get(m, "forwards"))) + " forwards";
    } else {
      bn = true;
      const int64_t before = static_cast<int64_t>(get(m, "batches_before", -1)),
                    after = static_cast<int64_t>(get(m, "batches_after", -1));
      what = after >= 0 ? "num_batches_tracked " + std::to_string(before) + " -> " + std::to_string(after) +
                              ", running_mean moved by up to " + num(get(m, "running_mean_moved"))
                        : "normalised with each evaluation batch's own statistics";
    }
    modules += (modules.empty() ? "" : "; ") + m.value("name", "") + " (" + m.value("type", "") + "): " + what;
  }
  std::string changed = bn && dropout ? "BatchNorm statistics changed and dropout was active during evaluation"
                        : bn          ? "BatchNorm running statistics changed during evaluation"
                                      : "dropout was active during evaluation";
  add(out, Severity::Warning, "eval_train_mode", "the evaluation ran in training mode: " + changed,
      std::to_string(found.size()) + " evaluation(s) (at step " + steps + ") ran modules in training mode; at step " +
          std::to_string(static_cast<int64_t>(get(last, "step"))) + ": " + modules,
      std::string("call model.eval() before evaluating and model.train() after: torch.no_grad / NoGradGuard turns "
                  "off gradients, not training mode") +
          (bn ? "; BatchNorm's running statistics now hold the evaluation data (reload them from a checkpoint "
                "saved before, or retrain)"
              : "") +
          (dropout ? "; the eval scores were measured with dropout on" : ""),
      static_cast<int64_t>(get(first, "step")));
}

/// Data-parallel: one rank's own work per step (its time outside the collective where the others
/// wait for it, cli/step_skew.h) well above the other ranks', window after window.
void check_rank_skew(const Run& r, Findings& out) {
  struct Window {
    int64_t step;
    std::vector<double> busy, step_ms, data_ms;
  };
  std::vector<Window> windows;
  for (size_t i = 0; i < r.train.size(); ++i) {
    const json& t = r.train[i];
    if (!t.contains("ranks") || !t["ranks"].is_object()) continue;
    Window w{static_cast<int64_t>(r.steps[i]), {}, {}, {}};
    for (const auto& v : t["ranks"].value("busy_ms", json::array())) w.busy.push_back(v.get<double>());
    for (const auto& v : t["ranks"].value("step_ms", json::array())) w.step_ms.push_back(v.get<double>());
    for (const auto& v : t["ranks"].value("data_ms", json::array())) w.data_ms.push_back(v.get<double>());
    if (w.busy.size() >= 2 && w.step_ms.size() == w.busy.size()) windows.push_back(std::move(w));
  }
  // The first window holds start-up (threads, first-touch allocations): left out when there are others.
  if (windows.size() > 1) windows.erase(windows.begin());
  if (windows.empty()) return;
  const size_t ranks = windows.front().busy.size();
  // Per window and rank: busy time over the median of the other ranks' busy times.
  int worst = -1;
  double worst_ratio = 0;
  for (size_t k = 0; k < ranks; ++k) {
    std::vector<double> ratios;
    int slow_windows = 0;
    for (const Window& w : windows) {
      if (w.busy.size() != ranks) continue;
      std::vector<double> others;
      for (size_t j = 0; j < ranks; ++j)
        if (j != k) others.push_back(w.busy[j]);
      const double m = median(others), own = w.busy[k];
      // Slow: 1.5x the others and a quarter of the step, so that noise on millisecond steps is not a straggler.
      const double ratio = m > 0 ? own / m : (own > 0 ? INFINITY : 1);
      ratios.push_back(ratio);
      if (ratio >= 1.5 && own - m >= 0.25 * w.step_ms[k] && own - m >= 2.0) ++slow_windows;
    }
    if (ratios.empty() || 2 * slow_windows < static_cast<int>(ratios.size())) continue;
    const double ratio = median(ratios);
    if (ratio > worst_ratio) worst = static_cast<int>(k), worst_ratio = ratio;
  }
  if (worst < 0) return;
  const size_t k = static_cast<size_t>(worst);
  std::vector<double> own, others, step_ms, own_data, others_data;
  for (const Window& w : windows) {
    own.push_back(w.busy[k]);
    step_ms.push_back(w.step_ms[k]);
    std::vector<double> o, od;
    for (size_t j = 0; j < ranks; ++j)
      if (j != k) {
        o.push_back(w.busy[j]);
        if (j < w.data_ms.size()) od.push_back(w.data_ms[j]);
      }
    others.push_back(median(o));
    if (k < w.data_ms.size()) own_data.push_back(w.data_ms[k]);
    if (!od.empty()) others_data.push_back(median(od));
  }
  const int64_t first = windows.front().step, last = windows.back().step;
  std::string ev = "its own work (step time outside the collective the others wait in) " + num(median(own)) +
                   " ms per step against a median of " + num(median(others)) + " ms on the other " +
                   std::to_string(ranks - 1) + " rank(s), median over " + std::to_string(windows.size()) +
                   " log windows; every rank's step takes " + num(median(step_ms)) + " ms";
  const bool data = !own_data.empty() && !others_data.empty() &&
                    median(own_data) - median(others_data) >= 0.5 * (median(own) - median(others));
  if (!own_data.empty())
    ev += "; waiting for data " + num(median(own_data)) + " ms per step on rank " + std::to_string(worst) +
          (others_data.empty() ? std::string() : ", " + num(median(others_data)) + " ms on the others");
  add(out, Severity::Warning, "rank_skew",
      "rank " + std::to_string(worst) + " is " + num(worst_ratio) + "x slower than the median over steps " +
          std::to_string(first) + "-" + std::to_string(last) + ": every other rank waits for it each step",
      ev,
      std::string(data ? "its data loading is the difference: a straggler transform or slower storage on that rank; "
                         "raise data.num_workers or make the transform cheaper. "
                       : "") +
          "Otherwise: unbalanced data (variable-length samples, uneven shards; bucket by length or balance the "
          "sampler), a slow or oversubscribed node (check its CPU load and OMP_NUM_THREADS), or per-rank work "
          "only that rank does",
      first);
}

/// Nothing to train: the start line counts no trainable parameter (every requires_grad = false, or the
/// optimizer built over an empty list). A loop then dies in backward ("does not require grad") or, when
/// something else keeps the loss in a graph, runs without learning.
void check_frozen(const Run& r, Findings& out) {
  if (r.starts.empty()) return;
  const json& s = r.starts.front();
  if (!s.contains("trainable_parameters") || get(s, "parameters") <= 0 || get(s, "trainable_parameters") > 0) return;
  std::string ev = "0 of " + std::to_string(static_cast<int64_t>(get(s, "parameters"))) +
                   " parameters require a gradient at the start of the run";
  int64_t step = 0;
  if (!r.errors.empty()) {
    std::string message = r.errors.front().value("message", "");
    message = message.substr(0, message.find('\n'));
    step = static_cast<int64_t>(get(r.errors.front(), "step"));
    ev += "; the run stopped at step " + std::to_string(step) + ": " + message;
  } else if (!r.loss.empty()) {
    ev += "; the loss went " + num(r.loss.front()) + " -> " + num(r.loss.back()) + " over " +
          std::to_string(r.loss.size()) + " logged steps";
  }
  add(out, Severity::Error, "frozen_model", "no parameter is trainable: the whole model is frozen", ev,
      "set requires_grad back on the layers to train (p.requires_grad_(true), or unfreeze the head after loading a "
      "backbone) and build the optimizer over them; freezing after the optimizer was built does not remove them "
      "from it, and unfreezing needs no new optimizer",
      step);
}

void check_amp(const Run& r, Findings& out) {
  // bf16 autocast on a CPU where its products computed in float32: no speed to gain from it there.
  for (const json& s : r.starts) {
    if (!s.contains("bf16_products") || s["bf16_products"].value("native", true)) continue;
    add(out, Severity::Info, "bf16_through_float32",
        "amp = \"bf16\" could not make this run faster: its products computed in float32",
        s["bf16_products"].value("why", std::string()),
        "for speed on this CPU train with amp = \"off\" (bf16 still halves activation memory); bf16 products run "
        "natively with AMX, or where the CPU's bf16 dot product does at least " +
            num(s["bf16_products"].value("native_from", 0.0)) + " of float32 FMA's flops per second",
        s.value("step", int64_t{-1}));
    break;
  }
  if (r.train.empty() || !r.train.back().contains("amp_scale")) return;
  const json& last = r.train.back();
  const double scale = get(last, "amp_scale"), skipped = get(last, "amp_skipped_steps");
  const double steps = get(last, "step");
  if (scale < 1 || (steps > 0 && skipped / steps > 0.2))
    add(out, Severity::Error, "amp_scale_collapse", "the fp16 loss scale collapsed: gradients overflow even unscaled",
        "amp_scale " + num(scale) + " at step " + std::to_string(static_cast<int64_t>(steps)) + ", " +
            std::to_string(static_cast<int64_t>(skipped)) + " of " + std::to_string(static_cast<int64_t>(steps)) +
            " steps skipped for inf/NaN gradients",
        "values overflow float16 (max 65504) in forward: use amp = \"bf16\", lower optim.lr, or find the layer whose "
        "activations blow up (train.anomaly = true)",
        static_cast<int64_t>(steps));
}

void check_status(const Run& r, Findings& out) {
  if (!r.summary.is_object()) {
    add(out, Severity::Info, "no_summary", "the run has no summary.json: it is still training or was killed",
        "metrics.jsonl ends at step " + std::to_string(r.steps.empty() ? 0 : static_cast<int64_t>(r.steps.back())),
        "kiln resume " + r.dir.string() + " continues it from its last checkpoint");
    return;
  }
  const std::string status = r.summary.value("status", "");
  if (status == "stopped" || status == "interrupted")
    add(out, Severity::Info, "stopped", "the run " + status + " before its last step",
        "step " + std::to_string(r.summary.value("steps", 0)) + " of " +
            std::to_string(r.summary.value("total_steps", 0)),
        "kiln resume " + r.dir.string());
  if (r.health.empty() && r.train.size() > 0)
    add(out, Severity::Info, "no_health", "no health records: gradient, update and activation checks were skipped",
        "metrics.jsonl has no {\"kind\":\"health\"} line (train.health = false, or a sharded run)",
        "train with train.health = true (the default)");
}

}  // namespace

std::vector<Finding> diagnose(const fs::path& run_dir) {
  const Run r = read_run(run_dir);
  Findings out;
  check_nonfinite(r, out);
  check_divergence_and_spikes(r, out);
  check_flat_loss(r, out);
  check_no_grad(r, out);
  check_gradient_depth(r, out);
  check_grad_accumulation(r, out);
  check_input_scale(r, out);
  check_dead_units(r, out);
  check_subnormal_state(r, out);
  check_update_ratio(r, out);
  check_overfitting(r, out);
  check_chance(r, out);
  check_schedule(r, out);
  check_data_and_memory(r, out);
  check_amp(r, out);
  check_eval_mode(r, out);
  check_frozen(r, out);
  check_rank_skew(r, out);
  check_status(r, out);
  std::stable_sort(out.begin(), out.end(), [](const Finding& a, const Finding& b) {
    if (a.severity != b.severity) return a.severity > b.severity;
    return a.step < b.step;
  });
  return out;
}

std::string format_findings(const std::vector<Finding>& findings) {
  std::string out;
  char buf[64];
  for (const auto& f : findings) {
    std::snprintf(buf, sizeof buf, "\n%-7s [", severity_name(f.severity));
    out += buf + f.code + "] " + f.title + "\n        evidence: " + f.evidence + "\n        fix: " + f.fix + "\n";
  }
  return out;
}

int doctor_command(const fs::path& run_dir, bool as_json) {
  const std::vector<Finding> findings = diagnose(run_dir);
  bool error = false;
  for (const auto& f : findings) error = error || f.severity == Severity::Error;
  if (as_json) {
    json arr = json::array();
    for (const auto& f : findings)
      arr.push_back({{"severity", severity_name(f.severity)},
                     {"code", f.code},
                     {"title", f.title},
                     {"evidence", f.evidence},
                     {"fix", f.fix},
                     {"step", f.step}});
    std::printf("%s\n", json{{"run", run_dir.string()}, {"findings", arr}}.dump(2).c_str());
    return error ? 1 : 0;
  }
  int counts[3] = {0, 0, 0};
  for (const auto& f : findings) ++counts[static_cast<int>(f.severity)];
  std::printf("kiln doctor %s: ", run_dir.string().c_str());
  if (findings.empty()) {
    std::printf("no findings: nothing in this run's metrics looks wrong\n");
    return 0;
  }
  std::printf("%zu finding(s): %d error(s), %d warning(s), %d info\n", findings.size(), counts[2], counts[1],
              counts[0]);
  std::fputs(format_findings(findings).c_str(), stdout);
  return error ? 1 : 0;
}

}  // namespace kiln::cli
