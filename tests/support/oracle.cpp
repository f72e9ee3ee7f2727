#include "support/oracle.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <unordered_map>

#include "kiln/io/safetensors.h"
#include "support/test_util.h"

namespace fs = std::filesystem;

namespace kiln::test {

namespace {

using json = nlohmann::json;

std::string oracle_script() { return source_dir() + "/tests/parity/oracle.py"; }

fs::path cache_dir() {
  if (const char* env = std::getenv("KILN_ORACLE_CACHE_DIR"); env && *env) return env;
#ifdef KILN_ORACLE_CACHE_DIR
  return KILN_ORACLE_CACHE_DIR;
#else
  return fs::temp_directory_path() / "kiln-oracle-cache";
#endif
}

// 128 bits from two independent 64-bit streams (FNV-1a and a multiply-xorshift);
// a cache key, not a security boundary.
class Hasher {
 public:
  void update(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < n; ++i) {
      a_ = (a_ ^ p[i]) * 0x100000001b3ULL;
      b_ = (b_ + p[i] + 0x9e3779b97f4a7c15ULL) * 0xbf58476d1ce4e5b9ULL;
      b_ ^= b_ >> 31;
    }
    // Separate fields so ("ab","c") and ("a","bc") differ.
    a_ = (a_ ^ n) * 0x100000001b3ULL;
    b_ = (b_ ^ n) * 0x94d049bb133111ebULL;
  }
  void update(const std::string& s) { update(s.data(), s.size()); }
  std::string hex() const {
    char buf[33];
    std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(a_),
                  static_cast<unsigned long long>(b_));
    return buf;
  }

 private:
  uint64_t a_ = 0xcbf29ce484222325ULL;
  uint64_t b_ = 0x6a09e667f3bcc908ULL;
};

// Fills outcomes from the oracle's results.json text and outputs file; false if they are malformed.
bool read_results(const std::string& results_text, const std::string& outputs_path, size_t ncases,
                  std::vector<OracleOutcome>& outcomes, std::string& why) {
  json res;
  try {
    res = json::parse(results_text);
  } catch (const json::exception& e) {
    why = std::string("results.json is not valid JSON: ") + e.what();
    return false;
  }
  if (!res.is_array() || res.size() != ncases) {
    why = "results.json does not hold one entry per case";
    return false;
  }
  io::SafetensorsFile outs;
  try {
    outs = io::load_safetensors(outputs_path);
  } catch (const Error& e) {
    why = std::string("cannot read the oracle's outputs: ") + e.what();
    return false;
  }
  std::unordered_map<std::string, Tensor> by_name;
  for (auto& [n, t] : outs.tensors) by_name.emplace(n, t);
  outcomes.assign(ncases, {});
  for (size_t i = 0; i < ncases; ++i) {
    const json& r = res[i];
    OracleOutcome& o = outcomes[i];
    o.ok = r.value("ok", false);
    if (!o.ok) {
      o.error = r.value("error", std::string("torch raised (no message)"));
      continue;
    }
    const json& kinds = r.at("kinds");
    if (r.contains("requires_grad")) {
      for (const json& b : r.at("requires_grad")) o.output_requires_grad.push_back(b.get<bool>());
    }
    for (size_t k = 0; k < kinds.size(); ++k) {
      if (kinds[k].get<std::string>() == "none") {  // a gradient torch returned as None
        o.outputs.emplace_back();
        o.is_number.push_back(false);
        continue;
      }
      const std::string name = "c" + std::to_string(i) + "." + std::to_string(k);
      auto it = by_name.find(name);
      if (it == by_name.end()) {
        why = "the oracle's outputs lack " + name;
        return false;
      }
      o.outputs.push_back(it->second);
      o.is_number.push_back(kinds[k].get<std::string>() == "number");
    }
  }
  return true;
}

}  // namespace

std::string torch_dtype(DType dt) { return "torch." + std::string(dtype_name(dt)); }

size_t OracleBatch::add(std::string id, std::string torch_expr, const std::vector<Tensor>& inputs) {
  if (ran_) throw std::logic_error("OracleBatch::add after run()");
  Case c;
  c.id = std::move(id);
  c.expr = std::move(torch_expr);
  const size_t idx = cases_.size();
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (!inputs[k].defined()) throw std::invalid_argument("OracleBatch::add: input x" + std::to_string(k) +
                                                          " of case '" + c.id + "' is undefined");
    std::string name = "c";  // built piecewise: g++ 12 warns falsely (-Wrestrict) on a chained "c" + ...
    name += std::to_string(idx);
    name += ".x";
    name += std::to_string(k);
    c.input_names.push_back(name);
    c.input_strides.push_back(inputs[k].strides().vec());
    inputs_.emplace_back(std::move(name), inputs[k].clone());  // a snapshot: kiln may modify inputs in place later
  }
  cases_.push_back(std::move(c));
  return idx;
}

size_t OracleBatch::add_grad(std::string id, std::string torch_expr, const std::vector<Tensor>& inputs,
                             const std::vector<int>& grad_inputs, const std::vector<Tensor>& grad_outputs) {
  const size_t idx = add(std::move(id), std::move(torch_expr), inputs);
  Case& c = cases_[idx];
  c.grad = true;
  c.grad_inputs = grad_inputs;
  for (size_t k = 0; k < grad_outputs.size(); ++k) {
    if (!grad_outputs[k].defined()) {
      c.grad_output_names.emplace_back();
      continue;
    }
    std::string name = "c";
    name += std::to_string(idx);
    name += ".g";
    name += std::to_string(k);
    c.grad_output_names.push_back(name);
    inputs_.emplace_back(std::move(name), grad_outputs[k].contiguous().clone());
  }
  return idx;
}

std::string OracleBatch::manifest_json() const {
  json cases = json::array();
  for (const auto& c : cases_) {
    json j = {{"id", c.id}, {"expr", c.expr}, {"inputs", c.input_names}, {"strides", c.input_strides}};
    if (c.grad) {
      json names = json::array();
      for (const auto& n : c.grad_output_names) names.push_back(n.empty() ? json(nullptr) : json(n));
      j["grad_inputs"] = c.grad_inputs;
      j["grad_outputs"] = names;
    }
    cases.push_back(std::move(j));
  }
  return json{{"version", 1}, {"cases", cases}}.dump(1);
}

const OracleOutcome& OracleBatch::outcome(size_t i) const {
  if (!ran_) throw std::logic_error("OracleBatch::outcome before run()");
  return outcomes_.at(i);
}

void OracleBatch::run() {
  if (ran_) return;
  const std::string manifest = manifest_json();
  const std::vector<uint8_t> inputs = io::serialize_safetensors(inputs_);
  Hasher h;
  h.update(read_file(oracle_script()));
  h.update(manifest);
  h.update(inputs.data(), inputs.size());
  const std::string key = h.hex();

  const fs::path dir = cache_dir();
  std::error_code ec;
  fs::create_directories(dir, ec);
  const fs::path cached_json = dir / (key + ".json"), cached_out = dir / (key + ".safetensors");
  const bool use_cache = !std::getenv("KILN_ORACLE_NO_CACHE");
  std::string why;
  if (use_cache && fs::exists(cached_json) && fs::exists(cached_out) &&
      read_results(read_file(cached_json.string()), cached_out.string(), cases_.size(), outcomes_, why)) {
    ran_ = from_cache_ = true;
    return;
  }

  if (const std::string& problem = python_problem(true); !problem.empty()) {
    throw std::runtime_error("the PyTorch oracle cannot run: " + problem);
  }
  static std::atomic<int> counter{0};
  const fs::path work = dir / ("tmp-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
  fs::create_directories(work);
  struct Cleanup {
    fs::path p;
    ~Cleanup() {
      std::error_code e;
      fs::remove_all(p, e);
    }
  } cleanup{work};
  {
    std::ofstream(work / "manifest.json") << manifest;
    std::ofstream f(work / "inputs.safetensors", std::ios::binary);
    f.write(reinterpret_cast<const char*>(inputs.data()), static_cast<std::streamsize>(inputs.size()));
    if (!f) throw std::runtime_error("oracle: cannot write inputs under " + work.string());
  }
  const std::string cmd = "timeout 900 " + shell_quote(python()) + " " + shell_quote(oracle_script()) + " " +
                          shell_quote(work.string());
  std::string output;
  const int rc = run_command(cmd, output);
  if (rc != 0) {
    throw std::runtime_error("the PyTorch oracle failed (exit " + std::to_string(rc) + ", " +
                             std::to_string(cases_.size()) + " cases): " + cmd + "\n" + output +
                             (rc == 3 ? "\nrun scripts/setup.sh" : ""));
  }
  const std::string results_text = read_file((work / "results.json").string());
  if (!read_results(results_text, (work / "outputs.safetensors").string(), cases_.size(), outcomes_, why)) {
    throw std::runtime_error("the PyTorch oracle returned malformed results: " + why + "\n" + output);
  }
  ran_ = true;
  // Outputs first, results last: a cache entry counts only when its results file exists.
  fs::rename(work / "outputs.safetensors", cached_out, ec);
  if (!ec) fs::rename(work / "results.json", cached_json, ec);
}

OracleOutcome torch_eval(const std::string& torch_expr, const std::vector<Tensor>& inputs) {
  OracleBatch b;
  b.add("eval", torch_expr, inputs);
  b.run();
  return b.outcome(0);
}

}  // namespace kiln::test
