#include "kiln/io/state_dict.h"

#include <cstring>
#include <map>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"

namespace kiln::io {

using detail::concat;

namespace {

// Tensors that alias exactly: the same element at the same place for every index.
bool same_memory(const Tensor& a, const Tensor& b) {
  return a.storage().get() == b.storage().get() && a.storage_offset() == b.storage_offset() && a.dtype() == b.dtype() &&
         a.sizes() == b.sizes() && a.strides() == b.strides();
}

}  // namespace

std::string rename_key(std::string_view key, const std::vector<KeyRename>& rules) {
  // Padding with dots lets one search find a segment at the start, middle or end.
  std::string s = concat(".", key, ".");
  for (const auto& r : rules) {
    KILN_CHECK(!r.from.empty(), ValueError, "rename_key: a rule has an empty 'from' (to \"", r.to,
               "\"); name the dotted segments to replace");
    const std::string from = concat(".", r.from, ".");
    const std::string to = r.to.empty() ? std::string(".") : concat(".", r.to, ".");
    for (size_t pos = s.find(from); pos != std::string::npos; pos = s.find(from, pos)) {
      s.replace(pos, from.size(), to);
      pos += to.size() - 1;  // the closing dot may open the next match
    }
  }
  return s.size() <= 2 ? std::string() : s.substr(1, s.size() - 2);
}

std::vector<KeyRename> inverse(const std::vector<KeyRename>& rules) {
  std::vector<KeyRename> out;
  for (auto it = rules.rbegin(); it != rules.rend(); ++it) {
    KILN_CHECK(!it->to.empty(), ValueError, "inverse: the rule \"", it->from,
               "\" -> \"\" drops segments and cannot be undone; give the reverse rules explicitly");
    out.push_back({it->to, it->from});
  }
  return out;
}

NamedTensors rename_keys(const NamedTensors& dict, const std::vector<KeyRename>& rules) {
  if (rules.empty()) return dict;
  NamedTensors out;
  out.reserve(dict.size());
  std::map<std::string, std::string> origin;  // new name -> old name
  std::string clashes;
  for (const auto& [name, t] : dict) {
    std::string n = rename_key(name, rules);
    KILN_CHECK(!n.empty(), ValueError, "rename_keys: \"", name, "\" is renamed to an empty name");
    auto [it, fresh] = origin.emplace(n, name);
    if (!fresh) {
      clashes += concat("\n  \"", it->second, "\" and \"", name, "\" both become \"", n, "\"");
      continue;
    }
    out.emplace_back(std::move(n), t);
  }
  KILN_CHECK(clashes.empty(), ValueError, "rename_keys: the rules map several keys to one name:", clashes);
  return out;
}

size_t consume_prefix_in_state_dict_if_present(NamedTensors& dict, std::string_view prefix) {
  if (prefix.empty()) return 0;
  // Checked before anything changes: stripping must not merge two keys into one.
  std::map<std::string, std::string> origin;  // new name -> old name
  std::string clashes;
  size_t changed = 0;
  for (const auto& [name, t] : dict) {
    const bool strip = name.starts_with(prefix);
    changed += strip;
    std::string n = strip ? name.substr(prefix.size()) : name;
    if (n.empty()) clashes += concat("\n  \"", name, "\" would become empty");
    auto [it, fresh] = origin.emplace(n, name);
    if (!fresh && (strip || it->second != n))
      clashes += concat("\n  \"", it->second, "\" and \"", name, "\" would both become \"", n, "\"");
  }
  KILN_CHECK(clashes.empty(), ValueError, "consume_prefix_in_state_dict_if_present: removing \"", prefix,
             "\" merges keys (the state dict mixes prefixed and unprefixed copies of a name):", clashes);
  for (auto& [name, t] : dict)
    if (name.starts_with(prefix)) name.erase(0, prefix.size());
  return changed;
}

NamedTensors cast_floating(const NamedTensors& dict, DType dtype) {
  KILN_CHECK(is_floating_point(dtype), DTypeError, "cast_floating: expected a floating-point dtype, got ",
             dtype_name(dtype));
  NoGradGuard g;
  NamedTensors out;
  out.reserve(dict.size());
  std::vector<std::pair<Tensor, Tensor>> done;  // original -> cast, so tied names stay one tensor
  for (const auto& [name, t] : dict) {
    if (!t.defined() || !t.is_floating_point() || t.dtype() == dtype) {
      out.emplace_back(name, t);
      continue;
    }
    Tensor c;
    for (auto& [orig, cast] : done)
      if (same_memory(orig, t)) c = cast;
    if (!c.defined()) {
      c = t.to(dtype).detach();
      done.emplace_back(t, c);
    }
    out.emplace_back(name, c);
  }
  return out;
}

std::vector<std::vector<std::string>> shared_groups(const NamedTensors& dict) {
  std::vector<std::vector<std::string>> groups;
  std::vector<const Tensor*> heads;
  for (const auto& [name, t] : dict) {
    if (!t.defined()) continue;
    size_t i = 0;
    while (i < heads.size() && !same_memory(*heads[i], t)) ++i;
    if (i == heads.size()) {
      heads.push_back(&t);
      groups.emplace_back();
    }
    groups[i].push_back(name);
  }
  std::erase_if(groups, [](const auto& g) { return g.size() < 2; });
  return groups;
}

bool equal_bytes(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined()) return a.defined() == b.defined();
  if (a.dtype() != b.dtype() || a.sizes() != b.sizes()) return false;
  Tensor x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.data_ptr(), y.data_ptr(), static_cast<size_t>(x.nbytes())) == 0;
}

void write_state_dict(const std::string& path, const NamedTensors& dict, const WriteStateDictOptions& o) {
  Metadata meta = o.metadata;
  meta.emplace("format", "pt");  // a caller's "format" wins
  NamedTensors out;
  out.reserve(dict.size());
  for (const auto& [name, t] : dict) {
    KILN_CHECK(t.defined(), ValueError, "write_state_dict '", path, "': tensor \"", name, "\" is undefined");
    out.emplace_back(name, t.detach());
  }
  if (o.dtype) out = cast_floating(out, *o.dtype);
  save_safetensors(path, out, meta);
}

SafetensorsFile read_state_dict(const std::string& path, const ReadStateDictOptions& o) {
  SafetensorsFile f = load_safetensors(path);
  if (o.dtype) f.tensors = cast_floating(f.tensors, *o.dtype);
  if (!o.renames.empty()) f.tensors = rename_keys(f.tensors, o.renames);
  return f;
}

}  // namespace kiln::io
