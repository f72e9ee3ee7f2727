// Optimizer state_dicts as safetensors files: tensors "state.<param>.<key>",
// everything else in the string metadata.
#include <cstdio>
#include <sstream>

#include "kiln/core/error.h"
#include "kiln/io/safetensors.h"
#include "kiln/optim/optimizer.h"

namespace kiln::optim {

namespace {

constexpr const char* kFormat = "kiln.optim.v1";

std::string num(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

double parse_num(const io::Metadata& md, const std::string& key, const std::string& path) {
  auto it = md.find(key);
  KILN_CHECK(it != md.end(), FormatError, path, ": expected metadata key '", key, "' in an optimizer state file");
  try {
    size_t used = 0;
    const double v = std::stod(it->second, &used);
    if (used == it->second.size()) return v;
  } catch (const std::exception&) {
  }
  throw FormatError(detail::concat(path, ": metadata '", key, "': expected a number, got '", it->second, "'"));
}

}  // namespace

void save_optimizer_state(const OptimizerStateDict& sd, const std::string& path) {
  io::NamedTensors tensors;
  io::Metadata md{{"format", kFormat}, {"param_groups", std::to_string(sd.param_groups.size())}};
  for (size_t i = 0; i < sd.param_groups.size(); ++i) {
    const auto& g = sd.param_groups[i];
    std::string names;
    for (size_t k = 0; k < g.param_names.size(); ++k) {
      KILN_CHECK(g.param_names[k].find('\n') == std::string::npos, ValueError,
                 "save_optimizer_state: expected parameter names without newlines, got '", g.param_names[k], "'");
      names += (k ? "\n" : "") + g.param_names[k];
    }
    md["group." + std::to_string(i) + ".params"] = names;
    for (const auto& [k, v] : g.options) md["group." + std::to_string(i) + ".option." + k] = num(v);
  }
  for (const auto& [name, st] : sd.state) {
    md["step." + name] = std::to_string(st.step);
    for (const auto& [k, t] : st.tensors) tensors.emplace_back("state." + name + "." + k, t);
  }
  io::save_safetensors(path, tensors, md);
}

OptimizerStateDict load_optimizer_state(const std::string& path) {
  io::SafetensorsFile f = io::load_safetensors(path);
  auto fmt = f.metadata.find("format");
  KILN_CHECK(fmt != f.metadata.end() && fmt->second == kFormat, FormatError, path, ": expected metadata format '",
             kFormat, "', got ", fmt == f.metadata.end() ? std::string("none") : "'" + fmt->second + "'");
  OptimizerStateDict sd;
  const auto ngroups = static_cast<size_t>(parse_num(f.metadata, "param_groups", path));
  sd.param_groups.resize(ngroups);
  for (size_t i = 0; i < ngroups; ++i) {
    const std::string prefix = "group." + std::to_string(i) + ".";
    auto it = f.metadata.find(prefix + "params");
    KILN_CHECK(it != f.metadata.end(), FormatError, path, ": expected metadata key '", prefix, "params'");
    std::istringstream is(it->second);
    for (std::string line; std::getline(is, line);) sd.param_groups[i].param_names.push_back(line);
    const std::string opt_prefix = prefix + "option.";
    for (const auto& [k, v] : f.metadata)
      if (k.rfind(opt_prefix, 0) == 0)
        sd.param_groups[i].options[k.substr(opt_prefix.size())] = parse_num(f.metadata, k, path);
  }
  for (const auto& [k, v] : f.metadata)
    if (k.rfind("step.", 0) == 0) sd.state[k.substr(5)].step = static_cast<int64_t>(parse_num(f.metadata, k, path));
  for (const auto& [name, t] : f.tensors) {
    const auto dot = name.rfind('.');
    KILN_CHECK(name.rfind("state.", 0) == 0 && dot != std::string::npos && dot > 6, FormatError, path,
               ": expected tensor names 'state.<param>.<key>', got '", name, "'");
    const std::string param = name.substr(6, dot - 6);
    KILN_CHECK(sd.state.count(param), FormatError, path, ": tensor '", name, "' has no step count 'step.", param,
               "' in the metadata");
    sd.state[param].tensors[name.substr(dot + 1)] = t;
  }
  return sd;
}

}  // namespace kiln::optim
