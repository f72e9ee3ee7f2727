#include "kiln/nn/pytorch_weights.h"

#include <fnmatch.h>

#include <map>
#include <set>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/ops/factory.h"

namespace kiln::nn {

using detail::concat;

namespace {

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "\"" : ", \"") + x + "\"";
  return s;
}

bool ignored(const std::string& key, const std::vector<std::string>& patterns) {
  for (const auto& p : patterns)
    if (fnmatch(p.c_str(), key.c_str(), 0) == 0) return true;
  return false;
}

// torch's BatchNorm fills a missing num_batches_tracked with 0 when the state
// dict carries no version metadata, which is always so for safetensors files.
bool is_batch_counter(const std::string& name, const Tensor& t) {
  return (name == "num_batches_tracked" || name.ends_with(".num_batches_tracked")) && t.dtype() == kInt64 &&
         t.dim() == 0;
}

bool convertible(DType from, DType to) {
  return (is_floating_point(from) && is_floating_point(to)) || (is_integral(from) && is_integral(to));
}

PyTorchLoadResult load_impl(Module& module, const NamedTensors& dict, const PyTorchLoadOptions& o,
                            const std::string& source) {
  // 1. The file's keys in the module's terms.
  NamedTensors file = dict;
  for (const auto& p : o.strip_prefixes) io::consume_prefix_in_state_dict_if_present(file, p);
  file = io::rename_keys(file, o.renames);

  PyTorchLoadResult res;
  std::vector<std::string> problems;
  std::map<std::string, const Tensor*> given;
  for (const auto& [n, t] : file) {
    if (ignored(n, o.ignore)) {
      res.ignored_keys.push_back(n);
      continue;
    }
    if (!given.emplace(n, &t).second) problems.push_back(concat("\"", n, "\" is given twice"));
  }

  // 2. Tied names: any one present supplies the others; present copies must agree.
  const NamedTensors expected = module.state_dict();
  std::map<std::string, std::string> tied_source;  // absent name -> the present name it takes
  for (const auto& group : io::shared_groups(expected)) {
    std::vector<std::string> present;
    for (const auto& n : group)
      if (given.count(n)) present.push_back(n);
    if (present.empty()) continue;
    for (size_t i = 1; i < present.size(); ++i)
      if (!io::equal_bytes(*given[present[0]], *given[present[i]]))
        problems.push_back(concat("tied weights \"", present[0], "\" and \"", present[i],
                                  "\" differ in the file (the module holds them as one tensor; torch's "
                                  "state_dict lists both with the same values)"));
    for (const auto& n : group)
      if (!given.count(n)) tied_source.emplace(n, present[0]);
  }

  // 3. Every module key: find its tensor, check shape and dtype, plan a cast.
  NamedTensors load;
  load.reserve(expected.size());
  std::set<std::string> wanted;
  std::vector<std::string> missing, mismatched;
  for (const auto& [name, dst] : expected) {
    wanted.insert(name);
    const Tensor* src = nullptr;
    if (auto it = given.find(name); it != given.end()) {
      src = it->second;
    } else if (auto ts = tied_source.find(name); ts != tied_source.end()) {
      src = given[ts->second];
      res.tied_filled.push_back(concat(name, " <- ", ts->second));
    } else if (is_batch_counter(name, dst)) {
      load.emplace_back(name, zeros({}, kInt64));
      res.defaulted.push_back(name);
      continue;
    } else {
      missing.push_back(name);
      continue;
    }
    if (!src->defined() || src->sizes() != dst.sizes()) {
      mismatched.push_back(concat("shape mismatch for \"", name, "\": the module has ", dst.shape_string(),
                                  ", the file ", src->defined() ? src->shape_string() : "an undefined tensor"));
      continue;
    }
    Tensor t = *src;
    if (t.dtype() != dst.dtype()) {
      if (!o.convert_dtype || !convertible(t.dtype(), dst.dtype())) {
        mismatched.push_back(concat("dtype mismatch for \"", name, "\": the module has ", dtype_name(dst.dtype()),
                                    ", the file ", dtype_name(t.dtype()),
                                    o.convert_dtype ? " (not converted between integer and floating point)"
                                                    : " (pass .convert_dtype = true to cast)"));
        continue;
      }
      NoGradGuard g;
      res.converted.push_back(concat(name, ": ", dtype_name(t.dtype()), " -> ", dtype_name(dst.dtype())));
      t = t.to(dst.dtype());
    }
    load.emplace_back(name, t);
  }
  std::vector<std::string> unexpected;  // in the file's order
  for (const auto& [n, t] : file)
    if (given.count(n) && !wanted.count(n)) unexpected.push_back(n);

  // 4. One report of everything, before anything changes.
  std::string msg;
  if (o.strict && !missing.empty()) msg += "\n  missing keys: " + join(missing);
  if (o.strict && !unexpected.empty()) msg += "\n  unexpected keys: " + join(unexpected);
  for (const auto& m : mismatched) msg += "\n  " + m;
  for (const auto& p : problems) msg += "\n  " + p;
  KILN_CHECK(msg.empty(), ValueError, "load_pytorch_weights: ", source, " does not fit ", module.type_name(),
             " (nothing was changed):", msg,
             o.strict && !unexpected.empty() && o.ignore.empty()
                 ? "\n  hint: keys torch keeps and kiln does not (a causal-mask buffer) can be skipped with "
                   ".ignore = {\"*.attn.bias\"}; renamed modules with .renames"
                 : "");
  if (!o.strict) {
    res.missing_keys = std::move(missing);
    res.unexpected_keys = std::move(unexpected);
  }
  module.load_state_dict(load, /*strict=*/false);
  return res;
}

}  // namespace

PyTorchLoadResult load_pytorch_state_dict(Module& module, const NamedTensors& dict, const PyTorchLoadOptions& o) {
  return load_impl(module, dict, o, "the state dict");
}

PyTorchLoadResult load_pytorch_weights(Module& module, const std::string& path, const PyTorchLoadOptions& o) {
  io::SafetensorsFile f = io::load_safetensors(path);
  return load_impl(module, f.tensors, o, concat("'", path, "'"));
}

NamedTensors pytorch_state_dict(const Module& module, const PyTorchExportOptions& o) {
  NamedTensors sd = io::rename_keys(module.state_dict(), o.renames);
  if (o.dtype) sd = io::cast_floating(sd, *o.dtype);
  return sd;
}

void save_pytorch_weights(const Module& module, const std::string& path, const PyTorchExportOptions& o) {
  io::WriteStateDictOptions w{.dtype = std::nullopt, .metadata = o.metadata};
  w.metadata.emplace("kiln.module", module.type_name());
  io::write_state_dict(path, pytorch_state_dict(module, o), w);
}

}  // namespace kiln::nn
