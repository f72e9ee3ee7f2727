// A synthetic run directory for the report tests: what `kiln train` writes,
// with knobs to drop fields and files the way broken or unfinished runs do.
#pragma once

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace kiln::test {

struct SyntheticRun {
  int train_lines = 300;
  int eval_every = 30;  // 0: no eval lines
  bool with_lr = true;
  bool with_memory = true;
  bool with_grad_norm = true;
  bool with_summary = true;
  bool with_config = true;
  bool bits_per_char = false;  // eval lines carry bits_per_char instead of accuracy
  // The run's story (Note [Run story] in src/cli/train.cpp): start, resume,
  // nonfinite and end records. Off: a run written before kiln recorded them.
  bool with_events = true;
  std::vector<int> resumes = {};  // interrupted at, and resumed from, these steps
  std::string end = "completed";  // the last process's end status; "": no end record (running or killed)
  bool nan_after = false;         // the loss of step train_lines + 1 was NaN (end becomes "nan")
  int total_steps = 0;            // 0: train_lines
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

/// A start, resume or end record.
inline std::string event_line(const char* kind, int step, int total, const std::string& status = "") {
  return std::string("{\"kind\":\"") + kind + "\",\"step\":" + std::to_string(step) +
         (status.empty() ? "" : ",\"status\":\"" + status + "\"") + ",\"total_steps\":" + std::to_string(total) +
         ",\"time_s\":" + std::to_string(step * 0.085) + "}";
}

/// Writes config.toml, metrics.jsonl and summary.json (as chosen) into dir, as
/// `kiln train` and `kiln resume` do: the summary is the last process's.
inline void write_synthetic_run(const std::filesystem::path& dir, const SyntheticRun& o = {}) {
  std::filesystem::create_directories(dir);
  if (o.with_config) std::ofstream(dir / "config.toml") << kSyntheticConfig;
  const int total = o.total_steps > 0 ? o.total_steps : o.train_lines;
  const std::string end = o.nan_after ? "nan" : o.end;
  std::ofstream m(dir / "metrics.jsonl");
  if (o.with_events) m << event_line("start", 0, total) << '\n';
  for (int step = 1; step <= o.train_lines; ++step) {
    for (int r : o.resumes)
      if (o.with_events && r == step - 1)
        m << event_line("end", r, total, "interrupted") << '\n' << event_line("resume", r, total) << '\n';
    m << train_line(o, step) << '\n';
    if (o.eval_every > 0 && step % o.eval_every == 0) m << eval_line(o, step) << '\n';
  }
  if (o.with_events && o.nan_after)
    m << "{\"kind\":\"nonfinite\",\"step\":" << o.train_lines + 1 << ",\"epoch\":" << o.train_lines / 100
      << ",\"lr\":0.003,\"loss\":\"NaN\"}\n";
  if (o.with_events && !end.empty()) m << event_line("end", o.train_lines, total, end) << '\n';
  // What src/cli/train.cpp writes when a process ends: a killed one leaves the previous process's, if any.
  const int summary_steps = !end.empty() ? o.train_lines : o.resumes.empty() ? -1 : o.resumes.back();
  if (o.with_summary && summary_steps >= 0)
    std::ofstream(dir / "summary.json")
        << "{\"name\":\"fashion_cnn\",\"config_path\":\"configs/fashion_cnn.toml\",\"steps\":" << summary_steps
        << ",\"total_steps\":" << total << ",\"status\":\"" << (end.empty() ? "interrupted" : end)
        << "\",\"wall_s\":" << o.train_lines * 0.085 + 3.2
        << ",\"final\":{\"loss\":0.35,\"lr\":1e-05,\"grad_norm\":0.61,\"samples_per_s\":1499.5,\"data_wait\":0.041,"
           "\"eval_loss\":0.2841,\"accuracy\":0.9123}}";
}

/// RUN/profile/ as `kiln train --profile 20:26` writes it (cli/profile_run.h): an op table of
/// `ops` rows and six steps whose breakdown has every category.
inline void write_synthetic_profile(const std::filesystem::path& dir, int ops = 18) {
  const std::filesystem::path p = dir / "profile";
  std::filesystem::create_directories(p);
  std::ofstream o(p / "ops.json");
  o << "{\"rows\": [";
  for (int i = 0; i < ops; ++i)
    o << (i ? ", " : "") << "{\"name\": \"op" << i << "\", \"kind\": \"" << (i % 3 ? "op" : "backward")
      << "\", \"calls\": " << 6 + i << ", \"self_us\": " << 900.0 / (i + 1) << ", \"total_us\": " << 1300.0 / (i + 1)
      << ", \"flops\": " << (i < 4 ? 2e8 / (i + 1) : 0.0) << ", \"gflops_per_s\": " << (i < 4 ? 40.0 + i : 0.0)
      << "}";
  o << "]}\n";
  std::ofstream s(p / "steps.json");
  s << "{\"world_size\": 1, \"window\": {\"first\": 20, \"end\": 26}, \"steps\": [";
  for (int k = 0; k < 6; ++k) {
    const double data = 1.0 + k % 2, fwd = 9.0 + k * 0.3, bwd = 16.0 - k * 0.2, opt = 4.0, comm = 2.5, other = 1.5;
    s << (k ? ", " : "") << "{\"step\": " << 20 + k << ", \"total_ms\": " << data + fwd + bwd + opt + comm + other
      << ", \"data_ms\": " << data << ", \"forward_ms\": " << fwd << ", \"backward_ms\": " << bwd
      << ", \"optimizer_ms\": " << opt << ", \"comm_exposed_ms\": " << comm << ", \"other_ms\": " << other << "}";
  }
  s << "]}\n";
  std::ofstream(p / "memory.json") << "{\"peak_total\": 23400000, \"peak\": {\"activation\": 9500000}}\n";
}

}  // namespace kiln::test
