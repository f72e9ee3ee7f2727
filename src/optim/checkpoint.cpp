// Training checkpoints (see include/kiln/optim/checkpoint.h): tensors under
// "model." and "optim.", everything else as flat string metadata, checksummed.
#include "kiln/optim/checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "kiln/core/error.h"
#include "kiln/core/generator.h"
#include "kiln/io/safetensors.h"

namespace kiln::optim {

namespace {

constexpr const char* kFormatKey = "kiln.checkpoint";
constexpr const char* kFormatVersion = "1";

std::string num(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string nums(const std::vector<double>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + num(v[i]);
  return s;
}

// FNV-1a 64 over every tensor's name, dtype, shape and bytes, in name order.
uint64_t checksum(const io::NamedTensors& tensors) {
  std::vector<const std::pair<std::string, Tensor>*> order;
  for (const auto& nt : tensors) order.push_back(&nt);
  std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->first < b->first; });
  uint64_t h = 0xcbf29ce484222325ULL;
  auto mix = [&h](const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ULL;
  };
  for (const auto* nt : order) {
    mix(nt->first.data(), nt->first.size() + 1);
    const int d = static_cast<int>(nt->second.dtype());
    mix(&d, sizeof d);
    for (int64_t s : nt->second.sizes()) mix(&s, sizeof s);
    Tensor c = nt->second.contiguous();
    mix(c.data_ptr(), static_cast<size_t>(c.nbytes()));
  }
  return h;
}

struct Reader {
  const io::Metadata& md;
  const std::string& path;
  const std::string& get(const std::string& key) const {
    auto it = md.find(key);
    KILN_CHECK(it != md.end(), FormatError, path, ": expected checkpoint metadata key '", key, "'");
    return it->second;
  }
  double number(const std::string& key) const { return parse(key, get(key)); }
  std::vector<double> numbers(const std::string& key) const {
    std::vector<double> out;
    std::istringstream is(get(key));
    for (std::string item; std::getline(is, item, ',');) out.push_back(parse(key, item));
    return out;
  }
  double parse(const std::string& key, const std::string& s) const {
    try {
      size_t used = 0;
      const double v = std::stod(s, &used);
      if (used == s.size()) return v;
    } catch (const std::exception&) {
    }
    throw FormatError(detail::concat(path, ": checkpoint metadata '", key, "': expected a number, got '", s, "'"));
  }
  // A number that must be a whole int64: casting a larger double (1e300, nan) is undefined behaviour.
  int64_t i64(const std::string& key) const {
    const double v = number(key);
    if (!(v >= -9223372036854775808.0 && v < 9223372036854775808.0) || v != static_cast<double>(static_cast<int64_t>(v))) {
      throw FormatError(detail::concat(path, ": checkpoint metadata '", key, "': expected an int64, got '", get(key), "'"));
    }
    return static_cast<int64_t>(v);
  }
  uint64_t u64(const std::string& key) const {
    const std::string& s = get(key);
    try {
      size_t used = 0;
      const uint64_t v = std::stoull(s, &used);
      if (used == s.size()) return v;
    } catch (const std::exception&) {
    }
    throw FormatError(detail::concat(path, ": checkpoint metadata '", key, "': expected an integer, got '", s, "'"));
  }
};

void put_scheduler(io::Metadata& md, const std::string& prefix, const SchedulerState& s) {
  md[prefix + "last_epoch"] = std::to_string(s.last_epoch);
  md[prefix + "step_count"] = std::to_string(s.step_count);
  md[prefix + "base_lrs"] = nums(s.base_lrs);
  md[prefix + "last_lr"] = nums(s.last_lr);
  for (const auto& [k, v] : s.extra) md[prefix + "extra." + k] = num(v);
  md[prefix + "children"] = std::to_string(s.children.size());
  for (size_t i = 0; i < s.children.size(); ++i)
    put_scheduler(md, prefix + "child." + std::to_string(i) + ".", s.children[i]);
}

SchedulerState get_scheduler(const Reader& r, const std::string& prefix) {
  SchedulerState s;
  s.last_epoch = r.i64(prefix + "last_epoch");
  s.step_count = r.i64(prefix + "step_count");
  s.base_lrs = r.numbers(prefix + "base_lrs");
  s.last_lr = r.numbers(prefix + "last_lr");
  const std::string extra = prefix + "extra.";
  for (auto it = r.md.lower_bound(extra); it != r.md.end() && it->first.rfind(extra, 0) == 0; ++it)
    s.extra[it->first.substr(extra.size())] = r.number(it->first);
  const auto n = static_cast<size_t>(r.u64(prefix + "children"));
  for (size_t i = 0; i < n; ++i) s.children.push_back(get_scheduler(r, prefix + "child." + std::to_string(i) + "."));
  return s;
}

std::string dims_str(IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

}  // namespace

void save_checkpoint(const std::string& path, const CheckpointRefs& refs, const CheckpointInfo& info) {
  KILN_CHECK(refs.model != nullptr, ValueError, "save_checkpoint: expected a model, got null");
  io::NamedTensors tensors;
  io::Metadata md{{kFormatKey, kFormatVersion}, {"step", std::to_string(info.step)}, {"config", info.config}};
  for (const auto& [name, t] : refs.model->state_dict()) tensors.emplace_back("model." + name, t);
  if (refs.optimizer) {
    const OptimizerStateDict sd = refs.optimizer->state_dict();
    md["optim.param_groups"] = std::to_string(sd.param_groups.size());
    for (size_t i = 0; i < sd.param_groups.size(); ++i) {
      const auto& g = sd.param_groups[i];
      std::string names;
      for (size_t k = 0; k < g.param_names.size(); ++k) {
        KILN_CHECK(g.param_names[k].find('\n') == std::string::npos, ValueError,
                   "save_checkpoint: expected parameter names without newlines, got '", g.param_names[k], "'");
        names += (k ? "\n" : "") + g.param_names[k];
      }
      const std::string p = "optim.group." + std::to_string(i) + ".";
      md[p + "params"] = names;
      for (const auto& [k, v] : g.options) md[p + "option." + k] = num(v);
    }
    for (const auto& [name, st] : sd.state) {
      md["optim.step." + name] = std::to_string(st.step);
      for (const auto& [k, t] : st.tensors) tensors.emplace_back("optim." + name + "." + k, t);
    }
  }
  if (refs.scheduler) put_scheduler(md, "sched.", refs.scheduler->state_dict());
  const GeneratorState g = default_generator().get_state();
  md["rng.default.seed"] = std::to_string(g.seed);
  md["rng.default.offset"] = std::to_string(g.offset);
  if (info.loader) {
    md["loader.epoch"] = std::to_string(info.loader->epoch);
    md["loader.position"] = std::to_string(info.loader->position);
    md["loader.seed"] = std::to_string(info.loader->seed);
  }
  char hex[20];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(checksum(tensors)));
  md["checksum.fnv1a64"] = hex;
  io::save_safetensors(path, tensors, md);
}

CheckpointInfo load_checkpoint(const std::string& path, const CheckpointRefs& refs) {
  KILN_CHECK(refs.model != nullptr, ValueError, "load_checkpoint: expected a model, got null");
  const io::SafetensorsFile f = io::load_safetensors(path);
  const Reader r{f.metadata, path};
  KILN_CHECK(r.get(kFormatKey) == kFormatVersion, FormatError, path, ": expected checkpoint format version ",
             kFormatVersion, ", got '", r.get(kFormatKey), "'");
  char hex[20];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(checksum(f.tensors)));
  KILN_CHECK(r.get("checksum.fnv1a64") == hex, FormatError, path, ": checksum mismatch: metadata says ",
             r.get("checksum.fnv1a64"), ", the tensor data hashes to ", hex, " (the file is corrupted)");

  // Split the tensors; check the model's keys, shapes and dtypes, all problems together.
  io::NamedTensors model_dict;
  std::map<std::string, Tensor> optim_tensors;
  for (const auto& [name, t] : f.tensors) {
    if (name.rfind("model.", 0) == 0)
      model_dict.emplace_back(name.substr(6), t);
    else if (name.rfind("optim.", 0) == 0)
      optim_tensors[name.substr(6)] = t;
    else
      throw FormatError(detail::concat(path, ": unexpected checkpoint tensor '", name, "'"));
  }
  std::vector<std::string> problems;
  std::map<std::string, Tensor> file_model(model_dict.begin(), model_dict.end());
  std::map<std::string, bool> seen;
  for (const auto& [name, t] : refs.model->state_dict()) {
    seen[name] = true;
    auto it = file_model.find(name);
    if (it == file_model.end()) {
      problems.push_back("missing key '" + name + "'");
      continue;
    }
    if (dims_str(it->second.sizes()) != dims_str(t.sizes()))
      problems.push_back("'" + name + "': shape " + dims_str(it->second.sizes()) + " in the file, " +
                         dims_str(t.sizes()) + " in the model");
    if (it->second.dtype() != t.dtype())
      problems.push_back(detail::concat("'", name, "': dtype ", dtype_name(it->second.dtype()), " in the file, ", dtype_name(t.dtype()),
                                        " in the model"));
  }
  for (const auto& [name, t] : model_dict)
    if (!seen.count(name)) problems.push_back("unexpected key '" + name + "'");
  if (!problems.empty()) {
    std::string msg;
    for (const auto& p : problems) msg += "\n  " + p;
    throw ValueError(detail::concat("load_checkpoint: ", path, " does not match the model (", problems.size(),
                                    " problems):", msg));
  }

  // Parse the rest before changing anything.
  OptimizerStateDict osd;
  if (refs.optimizer) {
    const auto ngroups = static_cast<size_t>(r.u64("optim.param_groups"));
    // Each group has its own metadata keys: more groups than keys is a hostile count, not an allocation.
    KILN_CHECK(ngroups <= f.metadata.size(), FormatError, path, ": checkpoint metadata 'optim.param_groups' says ",
               ngroups, " groups, but the file has only ", f.metadata.size(), " metadata keys");
    osd.param_groups.resize(ngroups);
    for (size_t i = 0; i < ngroups; ++i) {
      const std::string p = "optim.group." + std::to_string(i) + ".";
      std::istringstream is(r.get(p + "params"));
      for (std::string line; std::getline(is, line);) osd.param_groups[i].param_names.push_back(line);
      const std::string op = p + "option.";
      for (auto it = f.metadata.lower_bound(op); it != f.metadata.end() && it->first.rfind(op, 0) == 0; ++it)
        osd.param_groups[i].options[it->first.substr(op.size())] = r.number(it->first);
    }
    const std::string sp = "optim.step.";
    for (auto it = f.metadata.lower_bound(sp); it != f.metadata.end() && it->first.rfind(sp, 0) == 0; ++it)
      osd.state[it->first.substr(sp.size())].step = r.i64(it->first);
    for (const auto& [name, t] : optim_tensors) {
      const auto dot = name.rfind('.');
      KILN_CHECK(dot != std::string::npos && osd.state.count(name.substr(0, dot)), FormatError, path,
                 ": optimizer tensor 'optim.", name, "' has no step count in the metadata");
      osd.state[name.substr(0, dot)].tensors[name.substr(dot + 1)] = t;
    }
  }
  std::optional<SchedulerState> ssd;
  if (refs.scheduler) ssd = get_scheduler(r, "sched.");
  const GeneratorState gen{r.u64("rng.default.seed"), r.u64("rng.default.offset")};
  CheckpointInfo info;
  info.step = r.i64("step");
  info.config = r.get("config");
  if (f.metadata.count("loader.epoch"))
    info.loader = data::LoaderState{r.i64("loader.epoch"),
                                    r.i64("loader.position"), r.u64("loader.seed")};

  // Restore: the optimizer first (it validates its own names and shapes), then the rest.
  if (refs.optimizer) refs.optimizer->load_state_dict(osd);
  if (refs.scheduler) refs.scheduler->load_state_dict(*ssd);
  refs.model->load_state_dict(model_dict, /*strict=*/true);
  default_generator().set_state(gen);
  return info;
}

}  // namespace kiln::optim
