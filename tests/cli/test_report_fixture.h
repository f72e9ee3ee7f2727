// A synthetic run directory for the report tests: what `kiln train` writes,
// with knobs to drop fields and files the way broken or unfinished runs do.
#pragma once

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

namespace kiln::test {

struct SyntheticRun {
  int train_lines = 300;
  int eval_every = 30;       // 0: no eval lines
  bool with_lr = true;
  bool with_memory = true;
  bool with_grad_norm = true;
  bool with_summary = true;
  bool with_config = true;
  bool bits_per_char = false;  // eval lines carry bits_per_char instead of accuracy
};

inline constexpr const char* kSyntheticConfig =
    "# fashion_cnn, resolved\n"
    "[model]\nkind = \"cnn\"\nchannels = [32, 64]\n\n"
    "[optim]\nname = \"adamw\"\nlr = 0.003\nweight_decay = 0.05\n\n"
    "[train]\nsteps = 300\nbatch_size = 128\neval_every = 30\n";

/// One train record in metrics.jsonl's format (no trailing newline).
inline std::string train_line(const SyntheticRun& o, int step) {
  const double t = step;
  const double noise = 0.08 * std::sin(t * 12.9898) * std::cos(t * 4.1414);  // deterministic jitter
  const double loss = 2.2 * std::exp(-t / 60.0) + 0.32 + noise;
  const double warm = std::min(1.0, t / 30.0);
  const double lr = 0.003 * warm * 0.5 * (1 + std::cos(M_PI * t / (o.train_lines + 1)));
  char buf[1024];
  int n = std::snprintf(buf, sizeof buf,
                        "{\"kind\":\"train\",\"step\":%d,\"epoch\":%d,\"loss\":%.6f,\"samples_per_s\":%.1f,"
                        "\"data_wait\":%.4f,\"time_s\":%.3f",
                        step, step / 100, loss, 1500 + 120 * std::sin(t / 9.0), 0.03 + 0.025 * std::sin(t / 17.0),
                        t * 0.085);
  std::string s(buf, static_cast<size_t>(n));
  if (o.with_lr) s += ",\"lr\":" + std::to_string(lr);
  if (o.with_grad_norm) s += ",\"grad_norm\":" + std::to_string(1.5 * std::exp(-t / 150.0) + 0.4 + noise);
  if (o.with_memory) {
    const double activation = 9.5e6 + 1.5e6 * std::sin(t / 5.0);
    s += ",\"memory\":{\"parameter\":4800000,\"gradient\":1200000,\"optimizer_state\":2400000,\"activation\":" +
         std::to_string(static_cast<long>(activation)) + ",\"data\":600000}";
  }
  return s + "}";
}

inline std::string eval_line(const SyntheticRun& o, int step) {
  const double t = step;
  char buf[256];
  if (o.bits_per_char)
    std::snprintf(buf, sizeof buf, "{\"kind\":\"eval\",\"step\":%d,\"loss\":%.5f,\"bits_per_char\":%.5f}", step,
                  1.9 * std::exp(-t / 70.0) + 0.9, (1.9 * std::exp(-t / 70.0) + 0.9) / std::log(2.0));
  else
    std::snprintf(buf, sizeof buf, "{\"kind\":\"eval\",\"step\":%d,\"loss\":%.5f,\"accuracy\":%.5f}", step,
                  2.0 * std::exp(-t / 70.0) + 0.28, 0.9123 - 0.4 * std::exp(-t / 50.0));
  return buf;
}

/// Writes config.toml, metrics.jsonl and summary.json (as chosen) into dir.
inline void write_synthetic_run(const std::filesystem::path& dir, const SyntheticRun& o = {}) {
  std::filesystem::create_directories(dir);
  if (o.with_config) std::ofstream(dir / "config.toml") << kSyntheticConfig;
  std::ofstream m(dir / "metrics.jsonl");
  for (int step = 1; step <= o.train_lines; ++step) {
    m << train_line(o, step) << '\n';
    if (o.eval_every > 0 && step % o.eval_every == 0) m << eval_line(o, step) << '\n';
  }
  if (o.with_summary)
    std::ofstream(dir / "summary.json")
        << "{\"name\":\"fashion_cnn\",\"config_path\":\"configs/fashion_cnn.toml\",\"steps\":" << o.train_lines
        << ",\"wall_s\":" << o.train_lines * 0.085 + 3.2
        << ",\"final\":{\"test_accuracy\":0.9123,\"test_loss\":0.2841}}";
}

}  // namespace kiln::test
