// Training checkpoints (see include/kiln/train/checkpoint.h and
// docs/checkpoints.md): tensors under "model.", "optim." and "state.",
// everything else as flat string metadata; both checksummed.
#include "kiln/train/checkpoint.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>

#include "kiln/core/error.h"
#include "kiln/core/generator.h"
#include "kiln/core/record.h"
#include "kiln/io/safetensors.h"

namespace kiln::train {

using io::ObjectState;
using io::StateValue;
using optim::Optimizer;
using optim::OptimizerStateDict;
using optim::schedule_mismatches;
using optim::SchedulerState;

namespace {

constexpr const char* kFormatKey = "kiln.checkpoint";
constexpr const char* kFormatVersion = "2";  // 2 added named generators and objects; 1 still loads

std::string num(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string nums(const std::vector<double>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ',';
    s += num(v[i]);
  }
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

// FNV-1a 64 over every metadata key and value (NUL after each), in key order,
// except the checksum keys themselves: the scalars are state too, and a flipped
// digit in a step or a learning rate still parses.
uint64_t metadata_checksum(const io::Metadata& md) {
  uint64_t h = 0xcbf29ce484222325ULL;
  auto mix = [&h](const std::string& s) {
    for (size_t i = 0; i <= s.size(); ++i) h = (h ^ static_cast<unsigned char>(s.c_str()[i])) * 0x100000001b3ULL;
  };
  for (const auto& [k, v] : md) {
    if (k.rfind("checksum.", 0) == 0) continue;
    mix(k);
    mix(v);
  }
  return h;
}

std::string hex16(uint64_t v) {
  char hex[20];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(v));
  return hex;
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
  // Integers through stoll, not a cast from double: a hostile "1e300" must be an error, not UB.
  int64_t i64(const std::string& key) const { return parse_i64(key, get(key)); }
  int64_t parse_i64(const std::string& key, const std::string& s) const {
    try {
      size_t used = 0;
      const long long v = std::stoll(s, &used);
      if (used == s.size()) return v;
    } catch (const std::exception&) {
    }
    throw FormatError(detail::concat(path, ": checkpoint metadata '", key, "': expected an integer, got '", s, "'"));
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
  if (!s.type.empty()) md[prefix + "type"] = s.type;
  for (const auto& [k, v] : s.settings) md[prefix + "setting." + k] = num(v);
  md[prefix + "children"] = std::to_string(s.children.size());
  for (size_t i = 0; i < s.children.size(); ++i)
    put_scheduler(md, prefix + "child." + std::to_string(i) + ".", s.children[i]);
}

SchedulerState get_scheduler(const Reader& r, const std::string& prefix, int depth = 0) {
  // Real chains nest once or twice; a hostile file must not recurse the stack away.
  KILN_CHECK(depth <= 16, FormatError, r.path, ": checkpoint scheduler states nest deeper than 16 levels");
  SchedulerState s;
  s.last_epoch = r.i64(prefix + "last_epoch");
  s.step_count = r.i64(prefix + "step_count");
  s.base_lrs = r.numbers(prefix + "base_lrs");
  s.last_lr = r.numbers(prefix + "last_lr");
  const std::string extra = prefix + "extra.";
  for (auto it = r.md.lower_bound(extra); it != r.md.end() && it->first.rfind(extra, 0) == 0; ++it)
    s.extra[it->first.substr(extra.size())] = r.number(it->first);
  // Type and settings are absent from checkpoints written before they were
  // recorded; the scheduler then loads them unchecked, as it did.
  if (auto it = r.md.find(prefix + "type"); it != r.md.end()) s.type = it->second;
  const std::string setting = prefix + "setting.";
  for (auto it = r.md.lower_bound(setting); it != r.md.end() && it->first.rfind(setting, 0) == 0; ++it)
    s.settings[it->first.substr(setting.size())] = r.number(it->first);
  const auto n = static_cast<size_t>(r.u64(prefix + "children"));
  for (size_t i = 0; i < n; ++i)
    s.children.push_back(get_scheduler(r, prefix + "child." + std::to_string(i) + ".", depth + 1));
  return s;
}

std::string dims_str(IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

std::string join_lines(const std::vector<std::string>& names) {
  std::string s;
  for (size_t i = 0; i < names.size(); ++i) s += (i ? "\n" : "") + names[i];
  return s;
}

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream is(s);
  for (std::string line; std::getline(is, line);) out.push_back(line);
  return out;
}

template <typename Map>
std::vector<std::string> checked_names(const Map& m, const char* what) {
  std::vector<std::string> names;
  for (const auto& [name, ptr] : m) {
    KILN_CHECK(!name.empty() && name.find_first_of(".\n") == std::string::npos, ValueError,
               "save_checkpoint: expected ", what, " names that are non-empty and without '.' or newlines, got '", name,
               "'");
    KILN_CHECK(ptr != nullptr, ValueError, "save_checkpoint: ", what, " '", name, "' is null");
    names.push_back(name);
  }
  return names;
}

// Scalars as "<kind>:<text>"; doubles in hex (%a) so that they come back bit for bit.
std::string encode(const StateValue& v) {
  if (const auto* b = std::get_if<bool>(&v)) return *b ? "b:1" : "b:0";
  if (const auto* i = std::get_if<int64_t>(&v)) return "i:" + std::to_string(*i);
  if (const auto* d = std::get_if<double>(&v)) {
    char buf[48];
    std::snprintf(buf, sizeof buf, "f:%a", *d);
    return buf;
  }
  return "s:" + std::get<std::string>(v);
}

StateValue decode(const std::string& path, const std::string& key, const std::string& s) {
  auto bad = [&]() {
    return FormatError(detail::concat(path, ": checkpoint metadata '", key,
                                      "': expected b:0|1, i:<integer>, f:<hex float> or s:<text>, got '", s, "'"));
  };
  if (s.size() < 2 || s[1] != ':') throw bad();
  const std::string text = s.substr(2);
  switch (s[0]) {
    case 'b':
      if (text != "0" && text != "1") throw bad();
      return text == "1";
    case 'i':
    case 'f': {
      if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) throw bad();
      char* end = nullptr;
      errno = 0;
      if (s[0] == 'i') {
        const long long v = std::strtoll(text.c_str(), &end, 10);
        if (errno != 0 || *end != '\0') throw bad();
        return static_cast<int64_t>(v);
      }
      const double v = std::strtod(text.c_str(), &end);
      if (*end != '\0') throw bad();
      return v;
    }
    case 's': return text;
    default: throw bad();
  }
}

const char* kind_name(const StateValue& v) {
  static constexpr const char* names[] = {"bool", "integer", "double", "string"};
  return names[v.index()];
}

// Problems of `name` ("what" describes it) between the file's and the object's keys.
void compare_sets(const std::vector<std::string>& in_file, const std::vector<std::string>& in_refs, const char* what,
                  std::vector<std::string>& problems) {
  for (const auto& n : in_refs)
    if (std::find(in_file.begin(), in_file.end(), n) == in_file.end())
      problems.push_back(detail::concat("missing ", what, " '", n, "'"));
  for (const auto& n : in_file)
    if (std::find(in_refs.begin(), in_refs.end(), n) == in_refs.end())
      problems.push_back(detail::concat("unexpected ", what, " '", n, "'"));
}

// The object's saved state checked against its current one (the schema).
void compare_object(const std::string& name, const ObjectState& file, const ObjectState& now,
                    std::vector<std::string>& problems) {
  const std::string o = "object '" + name + "'";
  for (const auto& [k, t] : now.tensors) {
    auto it = file.tensors.find(k);
    if (it == file.tensors.end()) {
      problems.push_back(detail::concat(o, ": missing tensor '", k, "'"));
      continue;
    }
    if (dims_str(it->second.sizes()) != dims_str(t.sizes()))
      problems.push_back(detail::concat(o, ": tensor '", k, "': shape ", dims_str(it->second.sizes()), " in the file, ",
                                        dims_str(t.sizes()), " in the object"));
    if (it->second.dtype() != t.dtype())
      problems.push_back(detail::concat(o, ": tensor '", k, "': dtype ", dtype_name(it->second.dtype()),
                                        " in the file, ", dtype_name(t.dtype()), " in the object"));
  }
  for (const auto& [k, t] : file.tensors)
    if (!now.tensors.count(k)) problems.push_back(detail::concat(o, ": unexpected tensor '", k, "'"));
  for (const auto& [k, v] : now.values) {
    auto it = file.values.find(k);
    if (it == file.values.end())
      problems.push_back(detail::concat(o, ": missing value '", k, "'"));
    else if (it->second.index() != v.index())
      problems.push_back(detail::concat(o, ": value '", k, "': ", kind_name(it->second), " in the file, ", kind_name(v),
                                        " in the object"));
  }
  for (const auto& [k, v] : file.values)
    if (!now.values.count(k)) problems.push_back(detail::concat(o, ": unexpected value '", k, "'"));
}

// What Optimizer::load_state_dict checks (it throws on its own too, before changing anything),
// here so that its problems are reported with the model's, the scheduler's and the objects'.
void compare_optimizer(const OptimizerStateDict& file, const Optimizer& opt, std::vector<std::string>& problems) {
  const auto& groups = opt.param_groups();
  std::map<std::string, const Tensor*> params;
  for (const auto& g : groups)
    for (const auto& [n, p] : g.params) params[n] = &p;
  if (file.param_groups.size() != groups.size()) {
    problems.push_back(detail::concat("optimizer: ", file.param_groups.size(), " param groups in the file, ",
                                      groups.size(), " in the optimizer"));
  } else {
    for (size_t i = 0; i < groups.size(); ++i) {
      std::vector<std::string> mine;
      for (const auto& [n, p] : groups[i].params) mine.push_back(n);
      if (mine != file.param_groups[i].param_names)
        problems.push_back(detail::concat("optimizer: param group ", i, " has other parameters in the file (",
                                          file.param_groups[i].param_names.size(), ") than in the optimizer (",
                                          mine.size(), ")"));
    }
  }
  for (const auto& [n, st] : file.state) {
    auto it = params.find(n);
    if (it == params.end()) {
      problems.push_back(detail::concat("optimizer: state for '", n, "', which is not a parameter of the optimizer"));
      continue;
    }
    for (const auto& [k, t] : st.tensors)
      if (t.sizes() != it->second->sizes() || t.dtype() != it->second->dtype())
        problems.push_back(detail::concat("optimizer: state '", n, ".", k, "': ", t.shape_string(), " ",
                                          dtype_name(t.dtype()), " in the file, parameter ", it->second->shape_string(),
                                          " ", dtype_name(it->second->dtype())));
  }
}

// The scheduler's load_state_dict checks these only as it goes; checked here, nothing changes on a mismatch.
void compare_scheduler(const SchedulerState& file, const SchedulerState& now, const std::string& what,
                       std::vector<std::string>& problems) {
  if (file.base_lrs.size() != now.base_lrs.size())
    problems.push_back(detail::concat(what, ": ", file.base_lrs.size(), " base_lrs in the file, ", now.base_lrs.size(),
                                      " param groups in the optimizer"));
  if (file.children.size() != now.children.size()) {
    problems.push_back(detail::concat(what, ": ", file.children.size(), " chained schedulers in the file, ",
                                      now.children.size(), " given"));
    return;
  }
  for (size_t i = 0; i < file.children.size(); ++i)
    compare_scheduler(file.children[i], now.children[i], what + " " + std::to_string(i), problems);
}

// Called once at the top: schedule_mismatches walks the chained schedulers itself.
void compare_schedule_settings(const SchedulerState& file, const SchedulerState& now,
                               std::vector<std::string>& problems) {
  for (auto& m : schedule_mismatches(file, now, "scheduler")) problems.push_back(std::move(m));
}

// A profile's Checkpoint scopes carry the file's size.
int64_t file_bytes(const std::string& path) {
  std::error_code ec;
  const auto n = std::filesystem::file_size(path, ec);
  return ec ? 0 : static_cast<int64_t>(n);
}

}  // namespace

void save_checkpoint(const std::string& path, const CheckpointRefs& refs, const CheckpointInfo& info) {
  KILN_CHECK(refs.model != nullptr, ValueError, "save_checkpoint: expected a model, got null");
  record::Scope scope(record::Kind::Checkpoint, "checkpoint.save");
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
  md["rng.generators"] = join_lines(checked_names(refs.generators, "generator"));
  for (const auto& [name, gen] : refs.generators) {
    const GeneratorState gs = gen->get_state();
    md["rng.gen." + name + ".seed"] = std::to_string(gs.seed);
    md["rng.gen." + name + ".offset"] = std::to_string(gs.offset);
  }
  md["state.objects"] = join_lines(checked_names(refs.objects, "object"));
  for (const auto& [name, obj] : refs.objects) {
    const ObjectState st = obj->state_dict();
    for (const auto& [k, t] : st.tensors) tensors.emplace_back("state." + name + "." + k, t);
    for (const auto& [k, v] : st.values) md["state." + name + "." + k] = encode(v);
  }
  if (info.loader) {
    md["loader.epoch"] = std::to_string(info.loader->epoch);
    md["loader.position"] = std::to_string(info.loader->position);
    md["loader.seed"] = std::to_string(info.loader->seed);
  }
  md["checksum.fnv1a64"] = hex16(checksum(tensors));
  md["checksum.metadata.fnv1a64"] = hex16(metadata_checksum(md));
  io::save_safetensors(path, tensors, md);
  if (scope.recording()) scope.set_bytes(file_bytes(path));
}

CheckpointInfo load_checkpoint(const std::string& path, const CheckpointRefs& refs) {
  KILN_CHECK(refs.model != nullptr, ValueError, "load_checkpoint: expected a model, got null");
  record::Scope scope(record::Kind::Checkpoint, "checkpoint.load");
  if (scope.recording()) scope.set_bytes(file_bytes(path));
  const io::SafetensorsFile f = io::load_safetensors(path);
  const Reader r{f.metadata, path};
  KILN_CHECK(r.get(kFormatKey) == kFormatVersion || r.get(kFormatKey) == "1", FormatError, path,
             ": expected checkpoint format version 1 or ", kFormatVersion, ", got '", r.get(kFormatKey), "'");
  if (r.get(kFormatKey) != "1") {  // version 1 checksummed the tensors only
    const std::string mh = hex16(metadata_checksum(f.metadata));
    KILN_CHECK(r.get("checksum.metadata.fnv1a64") == mh, FormatError, path,
               ": metadata checksum mismatch: the file says ", r.get("checksum.metadata.fnv1a64"),
               ", the metadata hashes to ", mh, " (the file is corrupted)");
  }
  const std::string th = hex16(checksum(f.tensors));
  KILN_CHECK(r.get("checksum.fnv1a64") == th, FormatError, path, ": checksum mismatch: metadata says ",
             r.get("checksum.fnv1a64"), ", the tensor data hashes to ", th, " (the file is corrupted)");

  // Split the tensors; check the model's keys, shapes and dtypes, all problems together.
  io::NamedTensors model_dict;
  std::map<std::string, Tensor> optim_tensors;
  std::map<std::string, ObjectState> file_objects;
  const std::vector<std::string> object_names =
      f.metadata.count("state.objects") ? split_lines(r.get("state.objects")) : std::vector<std::string>{};
  for (const auto& n : object_names) file_objects[n];
  auto object_key = [&](const std::string& rest) -> std::pair<std::string, std::string> {
    const auto dot = rest.find('.');
    if (dot == std::string::npos || dot + 1 == rest.size() || !file_objects.count(rest.substr(0, dot))) return {};
    return {rest.substr(0, dot), rest.substr(dot + 1)};
  };
  for (const auto& [name, t] : f.tensors) {
    if (name.rfind("model.", 0) == 0) {
      model_dict.emplace_back(name.substr(6), t);
    } else if (name.rfind("optim.", 0) == 0) {
      optim_tensors[name.substr(6)] = t;
    } else if (name.rfind("state.", 0) == 0) {
      const auto [obj, key] = object_key(name.substr(6));
      KILN_CHECK(!obj.empty(), FormatError, path, ": checkpoint tensor '", name,
                 "' belongs to no object listed in 'state.objects'");
      file_objects[obj].tensors[key] = t;
    } else {
      throw FormatError(detail::concat(path, ": unexpected checkpoint tensor '", name, "'"));
    }
  }
  for (auto it = f.metadata.lower_bound("state."); it != f.metadata.end() && it->first.rfind("state.", 0) == 0; ++it) {
    if (it->first == "state.objects") continue;
    const auto [obj, key] = object_key(it->first.substr(6));
    KILN_CHECK(!obj.empty(), FormatError, path, ": checkpoint metadata '", it->first,
               "' belongs to no object listed in 'state.objects'");
    file_objects[obj].values[key] = decode(path, it->first, it->second);
  }
  const std::vector<std::string> gen_names =
      f.metadata.count("rng.generators") ? split_lines(r.get("rng.generators")) : std::vector<std::string>{};
  std::map<std::string, GeneratorState> file_gens;
  for (const auto& n : gen_names) file_gens[n] = {r.u64("rng.gen." + n + ".seed"), r.u64("rng.gen." + n + ".offset")};
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
      problems.push_back(detail::concat("'", name, "': dtype ", dtype_name(it->second.dtype()), " in the file, ",
                                        dtype_name(t.dtype()), " in the model"));
  }
  for (const auto& [name, t] : model_dict)
    if (!seen.count(name)) problems.push_back("unexpected key '" + name + "'");
  std::vector<std::string> ref_gens, ref_objects;
  for (const auto& [n, g] : refs.generators) {
    KILN_CHECK(g != nullptr, ValueError, "load_checkpoint: generator '", n, "' is null");
    ref_gens.push_back(n);
  }
  compare_sets(gen_names, ref_gens, "generator", problems);
  for (const auto& [n, o] : refs.objects) {
    KILN_CHECK(o != nullptr, ValueError, "load_checkpoint: object '", n, "' is null");
    ref_objects.push_back(n);
    if (file_objects.count(n) && !o->loads_any_saved_state())
      compare_object(n, file_objects[n], o->state_dict(), problems);
  }
  compare_sets(object_names, ref_objects, "object", problems);
  OptimizerStateDict osd;
  if (refs.optimizer) {  // parsed and checked here, so that its problems join the rest
    const auto ngroups = static_cast<size_t>(r.u64("optim.param_groups"));
    // Each group has a metadata key: no more groups than keys (a hostile count must not allocate).
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
    compare_optimizer(osd, *refs.optimizer, problems);
  }
  std::optional<SchedulerState> ssd;
  if (refs.scheduler) {
    ssd = get_scheduler(r, "sched.");
    const SchedulerState now = refs.scheduler->state_dict();
    compare_scheduler(*ssd, now, "scheduler", problems);
    compare_schedule_settings(*ssd, now, problems);
  }
  if (!problems.empty()) {
    std::string msg;
    for (const auto& p : problems) msg += "\n  " + p;
    throw ValueError(detail::concat("load_checkpoint: ", path, " does not match what it is loaded into (",
                                    problems.size(), " problems):", msg));
  }

  const GeneratorState gen{r.u64("rng.default.seed"), r.u64("rng.default.offset")};
  CheckpointInfo info;
  info.step = r.i64("step");
  info.config = r.get("config");
  if (f.metadata.count("loader.epoch"))
    info.loader = data::LoaderState{r.i64("loader.epoch"), r.i64("loader.position"), r.u64("loader.seed")};

  // Restore: the optimizer first (it validates its own names and shapes), then the rest.
  if (refs.optimizer) refs.optimizer->load_state_dict(osd);
  if (refs.scheduler) refs.scheduler->load_state_dict(*ssd);
  refs.model->load_state_dict(model_dict, /*strict=*/true);
  default_generator().set_state(gen);
  for (const auto& [n, g] : refs.generators) g->set_state(file_gens.at(n));
  for (const auto& [n, o] : refs.objects) o->load_state_dict(file_objects.at(n));
  return info;
}

}  // namespace kiln::train
