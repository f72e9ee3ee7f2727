// `kiln commbench` (cli/commbench.h): collective time and bandwidth over message sizes.
#include "cli/commbench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cli/config.h"
#include "cli/plan_model.h"
#include "kiln/core/half.h"
#include "kiln/dist/dist.h"
#include "kiln/dist/mpi_tuning.h"
#include "kiln/ops/factory.h"

namespace kiln::cli {

namespace {

using dist::Collective;
using json = nlohmann::json;

const Collective kAll[] = {Collective::AllReduce, Collective::ReduceScatter, Collective::AllGather,
                           Collective::AllToAll, Collective::Broadcast};

[[noreturn]] void flag_error(const std::string& flag, const std::string& value, const std::string& expected) {
  throw ConfigError("kiln commbench: " + flag + " " + (value.empty() ? "\"\"" : value) + ": expected " + expected);
}

std::string all_names() {
  std::string s;
  for (Collective c : kAll) s += std::string(s.empty() ? "" : ", ") + dist::collective_name(c);
  return s;
}

std::optional<Collective> collective_named(const std::string& name) {
  for (Collective c : kAll) {
    if (name == dist::collective_name(c)) return c;
  }
  return std::nullopt;
}

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> out;
  size_t at = 0;
  while (true) {
    const size_t next = text.find(sep, at);
    out.push_back(text.substr(at, next == std::string::npos ? std::string::npos : next - at));
    if (next == std::string::npos) return out;
    at = next + 1;
  }
}

std::vector<Collective> parse_ops(const std::string& text) {
  std::vector<Collective> out;
  for (const auto& name : split(text, ',')) {
    const auto c = collective_named(name);
    if (!c) flag_error("--ops", text, "a comma-separated list of " + all_names());
    if (std::find(out.begin(), out.end(), *c) != out.end()) flag_error("--ops", text, "each collective once");
    out.push_back(*c);
  }
  return out;
}

// nccl-tests' K, M, G (powers of 1024) beside kiln plan's units (KB: 1000, KiB: 1024).
int64_t parse_bytes(const std::string& flag, const std::string& text) {
  std::string t = text;
  if (!t.empty() && (t.back() == 'K' || t.back() == 'M' || t.back() == 'G')) t += "iB";
  const auto v = parse_byte_size(t);
  if (!v || *v < 1 || *v > 1e12 || *v != std::floor(*v)) {
    flag_error(flag, text, "a whole number of bytes >= 1: 8, 1024, 64K, 256M, 1G (powers of 1024), 1MB, 4MiB");
  }
  return static_cast<int64_t>(*v);
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
  return s;
}

// --algorithm: "default", one name for every selected collective that has it,
// or op=name pairs. Returns the choice per collective (absent: default).
std::map<Collective, std::string> parse_algorithm(const std::string& text, const std::vector<Collective>& ops) {
  std::map<Collective, std::string> out;
  if (text == "default") return out;
  if (text.find('=') == std::string::npos) {
    for (Collective c : ops) {
      const auto names = dist::tuned_algorithms(c);
      if (std::find(names.begin(), names.end(), text) != names.end()) out[c] = text;
    }
    if (out.empty()) {
      std::string listed;
      for (Collective c : ops) {
        listed += std::string("\n  ") + dist::collective_name(c) + ": " + join(dist::tuned_algorithms(c));
      }
      flag_error(
          "--algorithm", text,
          "default, op=name pairs, or a name that one of the selected collectives has; Open MPI's are:" + listed);
    }
    return out;
  }
  for (const auto& pair : split(text, ',')) {
    const size_t eq = pair.find('=');
    const auto c = eq == std::string::npos ? std::nullopt : collective_named(pair.substr(0, eq));
    if (!c) flag_error("--algorithm", text, "op=name pairs (op one of " + all_names() + "), e.g. allreduce=ring");
    const std::string name = pair.substr(eq + 1);
    const auto names = dist::tuned_algorithms(*c);
    if (name != "default" && std::find(names.begin(), names.end(), name) == names.end()) {
      flag_error("--algorithm", text,
                 std::string("for ") + dist::collective_name(*c) + " one of default, " + join(names));
    }
    if (name != "default") out[*c] = name;
  }
  return out;
}

// --wire: float32, or allreduce's buffers sent as 16 bits (allreduce alone has it).
DType parse_wire(const std::string& text, const std::vector<Collective>& ops) {
  DType wire;
  if (text == "float32") {
    return DType::Float32;
  } else if (text == "bf16" || text == "bfloat16") {
    wire = DType::BFloat16;
  } else if (text == "fp16" || text == "float16") {
    wire = DType::Float16;
  } else {
    flag_error("--wire", text, "float32, bf16 or fp16");
  }
  for (Collective c : ops) {
    if (c != Collective::AllReduce)
      flag_error("--wire", text,
                 std::string("float32 with ") + dist::collective_name(c) +
                     " (16-bit sending is allreduce's, as DDP's compression hooks use it: --ops allreduce)");
  }
  return wire;
}

const char* wire_name(DType wire) {
  return wire == DType::Float32 ? "float32" : wire == DType::BFloat16 ? "bf16" : "fp16";
}

// nccl-tests' bus-bandwidth factors: the bytes each rank's busiest link
// carries per byte of the message, for the optimal (ring) algorithm.
double bus_factor(Collective c, int n) {
  switch (c) {
    case Collective::AllReduce: return 2.0 * (n - 1) / n;
    case Collective::ReduceScatter:
    case Collective::AllGather:
    case Collective::AllToAll: return static_cast<double>(n - 1) / n;
    case Collective::Broadcast: return 1.0;
  }
  return 1.0;
}

const char* factor_formula(Collective c) {
  switch (c) {
    case Collective::AllReduce: return "2(n-1)/n";
    case Collective::Broadcast: return "1";
    default: return "(n-1)/n";
  }
}

// The checked inputs: distinct per rank and position, and sums over up to
// hundreds of ranks stay exact in float32.
float value(int rank, int64_t i) { return static_cast<float>((rank + 1) * 64 + i % 61); }

// One collective at one size: its buffers, its call, and the check of its result.
class Case {
 public:
  Case(Collective c, int64_t count, const dist::ProcessGroupPtr& g, DType wire = DType::Float32)
      : c_(c), count_(count), g_(g), wire_(wire) {
    n_ = g->size();
    me_ = g->rank();
    const TensorOptions f32 = TensorOptions().dtype(DType::Float32);
    const int64_t shard = count / n_;
    switch (c) {
      case Collective::AllReduce:
      case Collective::Broadcast: a_ = zeros({count}, f32); break;
      case Collective::ReduceScatter:
        a_ = zeros({count}, f32);
        b_ = zeros({shard}, f32);
        break;
      case Collective::AllGather:
        a_ = zeros({shard}, f32);
        b_ = zeros({count}, f32);
        break;
      case Collective::AllToAll:
        a_ = zeros({count}, f32);
        b_ = zeros({count}, f32);
        break;
    }
  }

  dist::WorkPtr issue() {
    switch (c_) {
      case Collective::AllReduce:
        return wire_ == DType::Float32 ? g_->allreduce(a_) : g_->allreduce_compressed(a_, wire_, dist::ReduceOp::Sum);
      case Collective::ReduceScatter: return g_->reduce_scatter_tensor(b_, a_);
      case Collective::AllGather: return g_->allgather_into_tensor(b_, a_);
      case Collective::AllToAll: return g_->alltoall(b_, a_);
      case Collective::Broadcast: return g_->broadcast(a_, 0);
    }
    return nullptr;
  }

  /// Runs the collective once on known inputs; the number of wrong output elements on this rank.
  int64_t check() {
    float* in = a_.data_ptr<float>();
    const int64_t in_n = a_.numel(), shard = count_ / n_;
    for (int64_t i = 0; i < in_n; ++i) in[i] = value(me_, i);
    issue()->wait();
    int64_t wrong = 0;
    const float* out =
        (c_ == Collective::AllReduce || c_ == Collective::Broadcast) ? a_.data_ptr<float>() : b_.data_ptr<float>();
    const int64_t out_n = (c_ == Collective::AllReduce || c_ == Collective::Broadcast) ? a_.numel() : b_.numel();
    for (int64_t i = 0; i < out_n; ++i) {
      float want = 0;
      switch (c_) {
        case Collective::AllReduce:
          for (int r = 0; r < n_; ++r) want += rounded(value(r, i));
          want = rounded(want);
          break;
        case Collective::ReduceScatter:
          for (int r = 0; r < n_; ++r) want += value(r, me_ * shard + i);
          break;
        case Collective::AllGather: want = value(static_cast<int>(i / shard), i % shard); break;
        case Collective::AllToAll: want = value(static_cast<int>(i / shard), me_ * shard + i % shard); break;
        case Collective::Broadcast: want = value(0, i); break;
      }
      if (c_ == Collective::AllReduce && wire_ != DType::Float32) {
        // Sent as 16 bits: each value rounded in and the sum once out, bitwise
        // through shared memory; MPI's reduction also rounds each partial sum,
        // so within one rounding per rank of the magnitudes summed.
        float mag = 0;
        for (int r = 0; r < n_; ++r) mag += std::fabs(rounded(value(r, i)));
        const float unit = wire_ == DType::BFloat16 ? 0x1p-8f : 0x1p-11f;
        wrong += !(std::fabs(out[i] - want) <= static_cast<float>(n_) * unit * mag);
      } else {
        wrong += out[i] != want;
      }
    }
    return wrong;
  }

 private:
  Collective c_;
  int64_t count_;
  dist::ProcessGroupPtr g_;
  DType wire_;
  int n_ = 1, me_ = 0;

  // A value as the wire carries it (itself in float32).
  float rounded(float x) const {
    if (wire_ == DType::BFloat16) return static_cast<float>(BFloat16(x));
    if (wire_ == DType::Float16) return static_cast<float>(Half(x));
    return x;
  }
  Tensor a_, b_;  // a_: the input (in place: also the output); b_: the output
};

struct Row {
  Collective op;
  int64_t bytes = 0, count = 0;
  double time_us = 0, algbw = 0, busbw = 0;
  int64_t wrong = 0;
};

// The element count for a message of `bytes`: float32 elements, a multiple of
// the rank count where the collective cuts the buffer into per-rank blocks.
int64_t count_for(Collective c, int64_t bytes, int n) {
  int64_t count = std::max<int64_t>(bytes / 4, 1);
  if (c == Collective::ReduceScatter || c == Collective::AllGather || c == Collective::AllToAll) {
    count = std::max<int64_t>(count / n * n, n);
  }
  return count;
}

Row measure(Collective c, int64_t count, int iters, int warmup, const dist::ProcessGroupPtr& g, DType wire) {
  Case k(c, count, g, wire);
  std::vector<dist::WorkPtr> works;
  for (int i = 0; i < warmup; ++i) works.push_back(k.issue());
  for (auto& w : works) w->wait();
  works.clear();
  g->barrier()->wait();
  // Issued back to back and waited for at the end, as nccl-tests does: the
  // time per call includes kiln's hand-over to its communication thread.
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) works.push_back(k.issue());
  for (auto& w : works) w->wait();
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
  works.clear();
  // The slowest rank's time is the collective's: the others finished early only to wait in the next one.
  Tensor t = empty({1}, TensorOptions().dtype(DType::Float32));
  t.data_ptr<float>()[0] = static_cast<float>(us);
  g->allreduce(t, dist::ReduceOp::Max)->wait();
  Tensor wrong = empty({1}, TensorOptions().dtype(DType::Int64));
  wrong.data_ptr<int64_t>()[0] = k.check();
  g->allreduce(wrong)->wait();

  Row r;
  r.op = c;
  r.count = count;
  r.bytes = count * 4;
  r.time_us = t.data_ptr<float>()[0];
  r.algbw = static_cast<double>(r.bytes) / (r.time_us * 1e-6) / 1e9;
  r.busbw = r.algbw * bus_factor(c, g->size());
  r.wrong = wrong.data_ptr<int64_t>()[0];
  return r;
}

int run_commbench(const CommbenchOptions& o);

}  // namespace

int commbench_command(const CommbenchOptions& o) {
  try {
    return run_commbench(o);
  } catch (const ConfigError&) {
    // Every rank parsed the same flags and found the same fault: one message
    // is enough (before dist::init the rank is known from Open MPI's environment).
    // The other ranks leave quietly, but not at once: mpirun aborts the job at
    // the first non-zero exit, and a rank 0 still writing its message would be
    // killed with it (seen on a loaded machine: no message at all). Rank 0's
    // own exit ends the wait, as mpirun then stops the rest.
    const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
    if (rank && std::string(rank) != "0") {
      std::this_thread::sleep_for(std::chrono::seconds(5));
      return 2;
    }
    throw;
  }
}

namespace {

int run_commbench(const CommbenchOptions& o) {
  const std::vector<Collective> ops = parse_ops(o.ops);
  const int64_t min_bytes = parse_bytes("--min-bytes", o.min_bytes),
                max_bytes = parse_bytes("--max-bytes", o.max_bytes);
  if (max_bytes < min_bytes) flag_error("--max-bytes", o.max_bytes, "at least --min-bytes (" + o.min_bytes + ")");
  if (o.iters < 1) flag_error("--iters", std::to_string(o.iters), "an integer >= 1");
  if (o.warmup < 0) flag_error("--warmup", std::to_string(o.warmup), "an integer >= 0");
  if (!o.json.empty()) {
    const auto dir = std::filesystem::absolute(o.json).parent_path();
    if (!std::filesystem::is_directory(dir)) flag_error("--json", o.json, "a file in an existing directory");
  }
  const DType wire = parse_wire(o.wire, ops);
  const std::map<Collective, std::string> forced = parse_algorithm(o.algorithm, ops);
  // Open MPI reads the choice in MPI_Init, so it goes into the environment first.
  for (const auto& [c, name] : forced) dist::force_tuned_algorithm(c, name);

  dist::init();
  int rc = 0;
  dist::run_or_abort([&] {
    const auto world = dist::world();
    const int n = world->size();
    const bool lead = world->rank() == 0;
    std::vector<Row> rows;
    json algorithms = json::object();
    if (lead) {
      std::printf(
          "# kiln commbench: %d rank%s, float32%s%s, %d iteration%s after %d warm-up; time: the mean per call "
          "on the slowest rank\n",
          n, n == 1 ? "" : "s", wire == DType::Float32 ? "" : " sent as ",
          wire == DType::Float32 ? "" : wire_name(wire), o.iters, o.iters == 1 ? "" : "s", o.warmup);
      if (n == 1)
        std::printf("# one rank moves nothing between processes: run under kiln launch -n N -- kiln commbench\n");
      std::printf("# algbw = size / time; busbw = algbw x factor (docs/distributed.md):");
      for (Collective c : ops) {
        if (c == Collective::Broadcast) {
          std::printf(" %s 1;", dist::collective_name(c));
        } else {
          std::printf(" %s %s = %.3g;", dist::collective_name(c), factor_formula(c), bus_factor(c, n));
        }
      }
      std::printf("\n# Open MPI algorithm (coll/tuned; default: chosen per call by size):");
    }
    for (Collective c : ops) {
      std::string eff = dist::tuned_algorithm_in_effect(c);
      if (o.algorithm != "default" && o.algorithm.find('=') == std::string::npos && !forced.count(c) &&
          eff == "default") {
        eff += " (no " + o.algorithm + ")";
      }
      algorithms[dist::collective_name(c)] = eff;
      if (lead) std::printf(" %s %s;", dist::collective_name(c), eff.c_str());
    }
    if (lead) {
      std::printf("\n#\n# %14s %12s %12s %12s %12s %12s %7s\n", "op", "size(B)", "count", "time(us)", "algbw(GB/s)",
                  "busbw(GB/s)", "wrong");
      std::fflush(stdout);
    }
    // The first call between two processes sets up their connection (shared
    // memory segments, ~1 ms): one untimed call of each collective first, so
    // that it is not charged to the first size.
    for (Collective c : ops) Case(c, count_for(c, min_bytes, n), world, wire).issue()->wait();
    for (Collective c : ops) {
      int64_t last = -1;
      for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2) {
        const int64_t count = count_for(c, bytes, n);
        if (count == last) continue;  // rounded to the same message as the size before
        last = count;
        const Row r = measure(c, count, o.iters, o.warmup, world, wire);
        rows.push_back(r);
        if (lead) {
          std::printf("  %14s %12lld %12lld %12.2f %12.4f %12.4f %7lld\n", dist::collective_name(c),
                      static_cast<long long>(r.bytes), static_cast<long long>(r.count), r.time_us, r.algbw, r.busbw,
                      static_cast<long long>(r.wrong));
          std::fflush(stdout);
        }
        if (bytes > max_bytes / 2) break;  // the next doubling would pass the maximum (or overflow)
      }
    }
    int64_t wrong = 0;
    if (lead) {
      std::printf("#\n# mean busbw over the sizes (GB/s):");
      for (Collective c : ops) {
        double sum = 0;
        int k = 0;
        for (const Row& r : rows) {
          if (r.op == c) sum += r.busbw, ++k;
        }
        std::printf(" %s %.4f;", dist::collective_name(c), k ? sum / k : 0.0);
      }
      std::printf("\n");
    }
    for (const Row& r : rows) wrong += r.wrong;
    if (lead && !o.json.empty()) {
      json j;
      j["ranks"] = n;
      j["dtype"] = "float32";
      j["wire"] = wire_name(wire);
      j["iters"] = o.iters;
      j["warmup"] = o.warmup;
      j["algorithms"] = algorithms;
      j["results"] = json::array();
      for (const Row& r : rows) {
        j["results"].push_back({{"op", dist::collective_name(r.op)},
                                {"bytes", r.bytes},
                                {"count", r.count},
                                {"time_us", r.time_us},
                                {"algbw_gbps", r.algbw},
                                {"busbw_gbps", r.busbw},
                                {"bus_factor", bus_factor(r.op, n)},
                                {"wrong", r.wrong}});
      }
      std::ofstream out(o.json);
      if (!out) throw ConfigError("kiln commbench: --json " + o.json + ": cannot write the file");
      out << j.dump(2) << "\n";
    }
    if (wrong > 0) {
      if (lead) {
        std::fprintf(stderr, "kiln: error: commbench: %lld output elements were wrong (see the wrong column)\n",
                     static_cast<long long>(wrong));
      }
      rc = 1;
    }
  });
  return rc;
}

}  // namespace

}  // namespace kiln::cli
