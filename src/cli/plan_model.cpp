// The formulas are derived and discussed in docs/memory.md ("Planning memory: kiln plan").
#include "cli/plan_model.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <stdexcept>

namespace kiln::cli {

namespace {

constexpr double kBucketBytes = 25.0 * 1024 * 1024;  // DDP's bucket_cap_mb (torch's and kiln's default)

bool sixteen_bit(PlanPrecision p) { return p != PlanPrecision::FP32; }

/// fp32 optimizer-state bytes per parameter.
double optimizer_bytes_per_param(PlanOptimizer o) {
  switch (o) {
    case PlanOptimizer::SGD: return 0;
    case PlanOptimizer::Momentum: return 4;         // momentum_buffer
    case PlanOptimizer::Adam: return 8;             // exp_avg, exp_avg_sq
    case PlanOptimizer::AdamW: return 8;            // the same
    case PlanOptimizer::RMSprop: return 4;          // square_avg
    case PlanOptimizer::RMSpropMomentum: return 8;  // square_avg, momentum_buffer
  }
  return 0;
}

std::string fmt(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

/// Korthikanti et al. (2022), eq. 2 and §4.1: bytes one transformer layer keeps for
/// backward, s b h (c0 + c1/t + c2 a s / (h t)); (10, 24, 5) in 16-bit, (18, 48, 9) in
/// fp32 (the same tensors at 4 bytes; dropout masks stay 1 byte).
double layer_activation_bytes(const PlanModel& m, int64_t b, int64_t t, bool half) {
  const double s = static_cast<double>(m.seq), h = static_cast<double>(m.d_model), a = static_cast<double>(m.heads);
  const double c0 = half ? 10 : 18, c1 = half ? 24 : 48, c2 = half ? 5 : 9;
  return s * static_cast<double>(b) * h *
         (c0 + c1 / static_cast<double>(t) + c2 * a * s / (h * static_cast<double>(t)));
}

struct Activations {
  double bytes = 0;
  std::string formula;
};

/// The transformer formula: stage layers × micro-batches in flight × per layer, plus
/// embedding output and fp32 logits.
Activations formula_activations(const PlanModel& m, const PlanLayout& l) {
  const bool half = sixteen_bit(l.precision);
  const double e = half ? 2 : 4;
  const int64_t b = l.micro_batch();
  const double s = static_cast<double>(m.seq), h = static_cast<double>(m.d_model);
  const double stage_layers = std::ceil(static_cast<double>(m.layers) / static_cast<double>(l.pp));
  const double in_flight = l.pp > 1 ? static_cast<double>(std::min(l.pp, l.micro_batches)) : 1.0;
  const double full = layer_activation_bytes(m, b, l.tp, half);
  const double per_layer = l.checkpointing ? s * static_cast<double>(b) * h * e : full;
  const double extra = s * static_cast<double>(b) * h * e +
                       4.0 * s * static_cast<double>(b) * static_cast<double>(m.vocab) / static_cast<double>(l.tp);
  Activations r;
  r.bytes = stage_layers * in_flight * per_layer + (l.checkpointing ? full : 0) + extra;
  const std::string sbh = "sbh";
  const std::string layer = half ? "sbh(10+24/t+5as/(ht))" : "sbh(18+48/t+9as/(ht))";
  r.formula = (l.checkpointing ? std::string(half ? "L/pp·f·2sbh + " : "L/pp·f·4sbh + ") + layer : "L/pp·f·" + layer) +
              (half ? " + 2sbh" : " + 4sbh") + " + 4sbV/t";
  return r;
}

}  // namespace

const char* plan_precision_name(PlanPrecision p) {
  switch (p) {
    case PlanPrecision::FP32: return "fp32";
    case PlanPrecision::BF16: return "bf16";
    case PlanPrecision::FP16: return "fp16";
  }
  return "?";
}

const char* plan_optimizer_name(PlanOptimizer o) {
  switch (o) {
    case PlanOptimizer::SGD: return "sgd";
    case PlanOptimizer::Momentum: return "momentum";
    case PlanOptimizer::Adam: return "adam";
    case PlanOptimizer::AdamW: return "adamw";
    case PlanOptimizer::RMSprop: return "rmsprop";
    case PlanOptimizer::RMSpropMomentum: return "rmsprop+momentum";
  }
  return "?";
}

const PlanRow& PlanResult::row(const std::string& category) const {
  for (const auto& r : rows)
    if (r.category == category) return r;
  throw std::out_of_range("no plan row " + category);
}

double gpt_param_count(int64_t layers, int64_t d_model, int64_t vocab, int64_t seq) {
  const double L = static_cast<double>(layers), h = static_cast<double>(d_model);
  return 12 * L * h * h + 13 * L * h + static_cast<double>(vocab) * h + static_cast<double>(seq) * h + 2 * h;
}

PlanResult plan_memory(const PlanModel& m, const PlanLayout& l) {
  auto bad = [](const std::string& flag, int64_t v, const std::string& why) {
    throw std::invalid_argument(flag + " " + std::to_string(v) + ": " + why);
  };
  if (l.dp < 1) bad("--dp", l.dp, "expected an integer >= 1");
  if (l.tp < 1) bad("--tp", l.tp, "expected an integer >= 1");
  if (l.pp < 1) bad("--pp", l.pp, "expected an integer >= 1");
  if (l.zero < 0 || l.zero > 3) bad("--zero", l.zero, "expected 0, 1, 2 or 3");
  if (l.batch < 1) bad("--batch", l.batch, "expected an integer >= 1");
  if (l.micro_batches < 1) bad("--micro-batches", l.micro_batches, "expected an integer >= 1");
  if (l.batch % l.micro_batches != 0)
    bad("--micro-batches", l.micro_batches, "must divide --batch " + std::to_string(l.batch));
  if (m.has_dims()) {
    if (m.heads % l.tp != 0) bad("--tp", l.tp, "must divide the number of heads (" + std::to_string(m.heads) + ")");
    if (l.pp > m.layers) bad("--pp", l.pp, "more pipeline stages than layers (" + std::to_string(m.layers) + ")");
  }
  if (!(m.params > 0)) throw std::invalid_argument("the model has no parameters: give --params or the dimensions");

  const bool half = sixteen_bit(l.precision);
  const bool master = half && !m.autocast_weights;  // 16-bit weights need an fp32 copy to update
  const double mp = static_cast<double>(l.tp * l.pp);
  const double dp = static_cast<double>(l.dp);
  const double psi = m.params / mp;  // this rank's model-parallel share
  const double fp32_share = (m.fp32_param_bytes > 0 ? m.fp32_param_bytes : 4 * m.params) / mp;
  const double weight_bytes = master ? 2 * psi : fp32_share;
  const std::string w = master ? "2Ψ" : "4Ψ";
  const std::string shard_note = mp > 1 ? " (Ψ = params/(tp·pp))" : "";

  PlanResult r;
  auto sharded = [&](int stage) { return l.zero >= stage && l.dp > 1; };
  auto add = [&](const std::string& cat, double bytes, const std::string& formula, bool state) {
    r.rows.push_back({cat, bytes, formula, state});
  };
  add("parameters", sharded(3) ? weight_bytes / dp : weight_bytes, (sharded(3) ? w + "/dp" : w) + shard_note, true);
  add("gradients", sharded(2) ? weight_bytes / dp : weight_bytes, sharded(2) ? w + "/dp" : w, true);
  const double k = optimizer_bytes_per_param(l.optimizer);
  const double opt = fp32_share * k / 4;
  const std::string kf = fmt(k) + "Ψ";
  add("optimizer_state", sharded(1) ? opt / dp : opt, k == 0 ? "0 (sgd)" : sharded(1) ? kf + "/dp" : kf, true);
  add("master_weights", master ? (sharded(1) ? fp32_share / dp : fp32_share) : 0,
      master ? (sharded(1) ? "4Ψ/dp" : "4Ψ") : (half ? "0 (autocast: weights stay fp32)" : "0 (fp32)"), true);

  // Activations and temporaries.
  const double e = half ? 2 : 4;
  const double b = static_cast<double>(l.micro_batch());
  const double stage_layers = m.layers > 0 ? std::ceil(static_cast<double>(m.layers) / static_cast<double>(l.pp)) : 1;
  const double in_flight = l.pp > 1 ? static_cast<double>(std::min(l.pp, l.micro_batches)) : 1.0;
  if (m.trace) {
    // With --checkpointing blocks the traced step runs the model's own per-block policy
    // (train.activation_checkpointing = "blocks"), so what it keeps is measured, not modelled.
    const PlanTrace t = m.trace(l.precision, l.micro_batch(), l.checkpointing);
    double act = t.activation;
    std::string how = "traced: one step at micro-batch " + std::to_string(l.micro_batch()) +
                      (l.checkpointing ? ", blocks checkpointed" : "");
    if (l.tp > 1 || l.pp > 1) {
      act = act / static_cast<double>(l.tp) * in_flight / static_cast<double>(l.pp);
      how += " × f/(tp·pp)";
    }
    add("activations", act, how, false);
    add("temporaries", t.workspace / static_cast<double>(l.tp), "traced: oneDNN scratchpads (Workspace peak)", false);
    add("input_batches", t.data, "traced: the loader's current and prefetched batches", false);
  } else if (m.has_dims()) {
    const Activations a = formula_activations(m, l);
    add("activations", a.bytes, a.formula, false);
    add("temporaries", 4.0 * static_cast<double>(m.seq) * b * static_cast<double>(m.vocab) / static_cast<double>(l.tp),
        "4sbV/t (the fp32 logits' gradient)", false);
  } else {
    add("activations", 0, "unknown: give --layers --d-model --heads --vocab --seq", false);
    add("temporaries", 0, "unknown: give the dimensions", false);
  }

  // Communication buffers.
  double comm = 0;
  std::string comm_f;
  auto plus = [&](double bytes, const std::string& f) {
    comm += bytes;
    comm_f += (comm_f.empty() ? "" : " + ") + f;
  };
  if (l.dp > 1)
    plus(std::min(2 * kBucketBytes, r.rows[1].bytes * (sharded(2) ? dp : 1)),
         "2 × 25 MiB buckets (at most the gradients)");
  if (sharded(3)) {
    if (m.layers > 0)
      plus(2 * (weight_bytes / stage_layers), "2 gathered layers (2·" + w + "/(L/pp))");
    else
      comm_f += (comm_f.empty() ? "" : " + ") + std::string("gathered layers unknown without --layers");
  }
  if (l.pp > 1 && m.has_dims())
    plus(2 * static_cast<double>(m.seq) * b * static_cast<double>(m.d_model) * e, "2sbh·bytes send/recv");
  add("communication", comm, comm_f.empty() ? "0 (one rank, or tp's in-place all-reduce)" : comm_f, false);

  for (const auto& row : r.rows) {
    r.total += row.bytes;
    if (row.model_state) r.model_states += row.bytes;
  }
  const auto top = std::max_element(r.rows.begin(), r.rows.end(),
                                    [](const PlanRow& x, const PlanRow& y) { return x.bytes < y.bytes; });
  r.dominant = top->category;
  return r;
}

std::vector<PlanLever> plan_levers(const PlanModel& m, const PlanLayout& l, double device_mem) {
  std::vector<PlanLever> out;
  // Tries the candidates in order; keeps the first that fits, else the last valid one.
  auto stepped = [&](const std::string& name, const std::vector<std::pair<std::string, PlanLayout>>& candidates) {
    std::optional<PlanLever> best;
    for (const auto& [change, layout] : candidates) {
      try {
        const double total = plan_memory(m, layout).total;
        best = PlanLever{name, change, layout, total, total <= device_mem};
        if (best->fits) break;
      } catch (const std::invalid_argument&) {  // not applicable to this model
      }
    }
    if (best) out.push_back(*best);
  };
  const bool has_activations = m.has_dims() || static_cast<bool>(m.trace);
  if (!l.checkpointing && m.has_dims()) {
    PlanLayout c = l;
    c.checkpointing = true;
    stepped("checkpointing", {{"--checkpointing blocks", c}});
  }
  if (l.dp > 1 && l.zero < 3) {
    std::vector<std::pair<std::string, PlanLayout>> c;
    for (int64_t z = l.zero + 1; z <= 3; ++z) {
      PlanLayout x = l;
      x.zero = z;
      c.push_back({"--zero " + std::to_string(z), x});
    }
    stepped("zero", c);
  }
  if (l.precision == PlanPrecision::FP32) {
    PlanLayout x = l;
    x.precision = PlanPrecision::BF16;
    stepped("bf16", {{"--precision bf16", x}});
  }
  for (const char* which : {"tp", "pp"}) {
    std::vector<std::pair<std::string, PlanLayout>> c;
    for (int64_t f = 2; f <= 8; f *= 2) {
      PlanLayout x = l;
      int64_t& v = std::string(which) == "tp" ? x.tp : x.pp;
      v *= f;
      if (std::string(which) == "pp" && x.micro_batches < x.pp && x.batch % x.pp == 0) x.micro_batches = x.pp;
      c.push_back({std::string("--") + which + " " + std::to_string(v), x});
    }
    stepped(which, c);
  }
  if (has_activations && l.micro_batch() > 1) {
    std::vector<std::pair<std::string, PlanLayout>> c;
    for (int64_t mb = l.micro_batches * 2; mb <= l.batch; mb *= 2) {
      if (l.batch % mb != 0) continue;
      PlanLayout x = l;
      x.micro_batches = mb;
      c.push_back({"--micro-batches " + std::to_string(mb), x});
    }
    stepped("micro_batches", c);
  }
  if (has_activations && l.batch > 1) {
    std::vector<std::pair<std::string, PlanLayout>> c;
    for (int64_t b = l.batch / 2; b >= 1; b /= 2) {
      PlanLayout x = l;
      x.batch = b;
      if (b % x.micro_batches != 0) x.micro_batches = 1;
      c.push_back({"--batch " + std::to_string(b), x});
    }
    stepped("batch", c);
  }
  return out;
}

std::optional<double> parse_byte_size(const std::string& text) {
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(text, &pos);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  std::string unit = text.substr(pos);
  unit.erase(std::remove_if(unit.begin(), unit.end(), [](unsigned char c) { return std::isspace(c); }), unit.end());
  static const std::pair<const char*, double> kUnits[] = {{"", 1},
                                                          {"B", 1},
                                                          {"KB", 1e3},
                                                          {"MB", 1e6},
                                                          {"GB", 1e9},
                                                          {"TB", 1e12},
                                                          {"KiB", 1024.0},
                                                          {"MiB", 1024.0 * 1024},
                                                          {"GiB", 1024.0 * 1024 * 1024},
                                                          {"TiB", 1024.0 * 1024 * 1024 * 1024}};
  for (const auto& [name, scale] : kUnits)
    if (unit == name) {
      if (!std::isfinite(v) || v <= 0) return std::nullopt;
      return v * scale;
    }
  return std::nullopt;
}

}  // namespace kiln::cli
