// `kiln profile RUN_DIR` and the reading of RUN_DIR/profile/ (cli/profile_files.h).
#include "cli/profile_files.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "cli/config.h"

namespace kiln::cli {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::optional<json> read_json(const fs::path& path, std::vector<std::string>& problems) {
  std::ifstream in(path);
  if (!in) {
    problems.push_back(path.filename().string() + " is missing");
    return std::nullopt;
  }
  json j = json::parse(in, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    problems.push_back(path.filename().string() + " is not a JSON object (cut short or edited?)");
    return std::nullopt;
  }
  return j;
}

double num(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : 0.0;
}
std::string text(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

/// Milliseconds with three significant digits at least, as a table cell.
std::string ms(double us) { return us >= 1e5 ? fmt("%.1f", us / 1e3) : fmt("%.3f", us / 1e3); }

std::string si(double v) {
  if (v <= 0) return "-";
  if (v >= 1e12) return fmt("%.2fT", v / 1e12);
  if (v >= 1e9) return fmt("%.2fG", v / 1e9);
  if (v >= 1e6) return fmt("%.2fM", v / 1e6);
  if (v >= 1e3) return fmt("%.2fk", v / 1e3);
  return fmt("%.0f", v);
}

std::string bytes_cell(double b) {
  if (b <= 0) return "-";
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  return fmt(u == 0 ? "%.0f" : "%.1f", b) + " " + units[u];
}

std::string clip(const std::string& s, size_t width) { return s.size() <= width ? s : s.substr(0, width - 3) + "..."; }

}  // namespace

std::optional<ProfileFiles> read_profile(const fs::path& run_dir) {
  const fs::path dir = run_dir / "profile";
  if (!fs::exists(dir / "ops.json")) return std::nullopt;
  ProfileFiles p;
  p.dir = dir;
  if (auto ops = read_json(dir / "ops.json", p.problems)) {
    auto rows = ops->find("rows");
    if (rows == ops->end() || !rows->is_array()) {
      p.problems.push_back("ops.json has no \"rows\" array");
    } else {
      for (const json& r : *rows) {
        if (!r.is_object()) continue;
        OpRow o;
        o.name = text(r, "name");
        o.kind = text(r, "kind");
        o.input_shapes = text(r, "input_shapes");
        o.calls = static_cast<int64_t>(num(r, "calls"));
        o.self_us = num(r, "self_us");
        o.total_us = num(r, "total_us");
        o.flops = num(r, "flops");
        o.gflops_per_s = num(r, "gflops_per_s");
        o.bytes = static_cast<int64_t>(num(r, "bytes"));
        o.alloc_bytes = static_cast<int64_t>(num(r, "alloc_bytes"));
        p.ops.push_back(std::move(o));
      }
    }
  }
  if (auto steps = read_json(dir / "steps.json", p.problems)) {
    p.world_size = static_cast<int>(std::max(1.0, num(*steps, "world_size")));
    auto rows = steps->find("steps");
    if (rows != steps->end() && rows->is_array()) {
      for (const json& r : *rows) {
        if (!r.is_object()) continue;
        p.steps.push_back({static_cast<int64_t>(num(r, "step")), num(r, "total_ms"), num(r, "data_ms"),
                           num(r, "forward_ms"), num(r, "backward_ms"), num(r, "optimizer_ms"),
                           num(r, "comm_exposed_ms"), num(r, "other_ms")});
      }
    } else {
      p.problems.push_back("steps.json has no \"steps\" array");
    }
  }
  if (fs::exists(dir / "memory.json")) p.memory = read_json(dir / "memory.json", p.problems);
  return p;
}

void sort_ops(std::vector<OpRow>& rows, const std::string& key) {
  double OpRow::*field = nullptr;
  if (key == "self")
    field = &OpRow::self_us;
  else if (key == "total")
    field = &OpRow::total_us;
  else if (key == "flops")
    field = &OpRow::flops;
  else if (key != "calls")
    throw ConfigError("kiln profile: --sort expects " + std::string(kProfileSortKeys) + ", got \"" + key + "\"");
  std::stable_sort(rows.begin(), rows.end(), [&](const OpRow& a, const OpRow& b) {
    if (field) return a.*field > b.*field;
    return a.calls > b.calls;
  });
}

std::string format_ops(const std::vector<OpRow>& rows, size_t top) {
  double self_sum = 0;
  for (const OpRow& r : rows) self_sum += r.self_us;
  const size_t n = top == 0 ? rows.size() : std::min(top, rows.size());
  std::ostringstream o;
  char line[320];
  std::snprintf(line, sizeof line, "%-36s %-14s %7s %11s %7s %11s %9s %9s %10s\n", "name", "kind", "calls", "self ms",
                "self %", "total ms", "FLOP", "GFLOP/s", "bytes");
  o << line << std::string(120, '-') << "\n";
  for (size_t i = 0; i < n; ++i) {
    const OpRow& r = rows[i];
    std::snprintf(line, sizeof line, "%-36s %-14s %7lld %11s %6.1f%% %11s %9s %9s %10s\n", clip(r.name, 36).c_str(),
                  clip(r.kind, 14).c_str(), static_cast<long long>(r.calls), ms(r.self_us).c_str(),
                  self_sum > 0 ? 100 * r.self_us / self_sum : 0.0, ms(r.total_us).c_str(), si(r.flops).c_str(),
                  r.gflops_per_s > 0 ? fmt("%.3g", r.gflops_per_s).c_str() : "-",
                  bytes_cell(static_cast<double>(r.bytes)).c_str());
    o << line;
  }
  o << std::string(120, '-') << "\n";
  std::snprintf(line, sizeof line, "%zu of %zu rows; self time in all rows: %s ms\n", n, rows.size(),
                ms(self_sum).c_str());
  o << line;
  return o.str();
}

std::string format_steps(const std::vector<StepRow>& steps) {
  std::ostringstream o;
  char line[240];
  std::snprintf(line, sizeof line, "%-8s %10s %9s %9s %9s %10s %10s %9s\n", "step", "total ms", "data", "forward",
                "backward", "optimizer", "comm exp.", "other");
  o << line;
  StepRow mean;
  auto row = [&](const std::string& label, const StepRow& s) {
    std::snprintf(line, sizeof line, "%-8s %10.2f %9.2f %9.2f %9.2f %10.2f %10.2f %9.2f\n", label.c_str(), s.total_ms,
                  s.data_ms, s.forward_ms, s.backward_ms, s.optimizer_ms, s.comm_exposed_ms, s.other_ms);
    o << line;
  };
  for (const StepRow& s : steps) {
    row(std::to_string(s.step), s);
    mean.total_ms += s.total_ms;
    mean.data_ms += s.data_ms;
    mean.forward_ms += s.forward_ms;
    mean.backward_ms += s.backward_ms;
    mean.optimizer_ms += s.optimizer_ms;
    mean.comm_exposed_ms += s.comm_exposed_ms;
    mean.other_ms += s.other_ms;
  }
  if (steps.size() > 1) {
    const double k = static_cast<double>(steps.size());
    for (double* v : {&mean.total_ms, &mean.data_ms, &mean.forward_ms, &mean.backward_ms, &mean.optimizer_ms,
                      &mean.comm_exposed_ms, &mean.other_ms})
      *v /= k;
    row("mean", mean);
  }
  return o.str();
}

int profile_command(const fs::path& run_dir, const std::string& sort, int64_t top) {
  if (!fs::is_directory(run_dir)) throw ConfigError(run_dir.string() + ": no such run directory");
  if (top < 0)
    throw ConfigError("kiln profile: --top expects a number of rows >= 0 (0: all), got " + std::to_string(top));
  std::optional<ProfileFiles> p = read_profile(run_dir);
  if (!p)
    throw ConfigError(run_dir.string() +
                      " has no profile (no profile/ops.json): record one with `kiln train CONFIG --profile 20:25` "
                      "(or [profile] steps = \"20:25\" in the config)");
  sort_ops(p->ops, sort);
  const std::string by = sort == "calls" ? "calls" : sort == "flops" ? "FLOPs" : sort + " time";
  std::printf("profile of %s (%s)\n\nops by %s%s:\n%s", run_dir.string().c_str(), p->dir.string().c_str(), by.c_str(),
              p->world_size > 1 ? " (rank 0)" : "", format_ops(p->ops, static_cast<size_t>(top)).c_str());
  if (!p->steps.empty())
    std::printf("\nper-step breakdown (ms%s):\n%s", p->world_size > 1 ? ", rank 0" : "",
                format_steps(p->steps).c_str());
  if (p->memory && p->memory->contains("peak_total"))
    std::printf("\npeak live memory in the window: %s\n", bytes_cell(num(*p->memory, "peak_total")).c_str());
  if (fs::exists(p->dir / "trace.json"))
    std::printf("\ntrace: %s (open it in https://ui.perfetto.dev or chrome://tracing)\n",
                (p->dir / "trace.json").string().c_str());
  for (const std::string& problem : p->problems) std::fprintf(stderr, "kiln profile: warning: %s\n", problem.c_str());
  return 0;
}

}  // namespace kiln::cli
