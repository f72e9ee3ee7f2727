// INT4 checkpoints (include/kiln/quant/int4.h): save_int4 / load_int4, which
// checks every tensor of a file before it changes the model.
#include <cmath>
#include <map>
#include <unordered_map>

#include "int4_internal.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"

namespace kiln::quant {
namespace {

using kiln::detail::concat;

constexpr const char* kQuantizedKey = "kiln.quantized";
constexpr const char* kInt4Value = "int4-weight-only";

std::string describe(const Tensor& t) { return std::string(dtype_name(t.dtype())) + " " + t.shape_string(); }

const Tensor& expect(const io::SafetensorsFile& f, const std::string& file, const std::string& name, DType dtype,
                     std::vector<int64_t> shape) {
  std::string want = std::string(dtype_name(dtype)) + " [";
  for (size_t i = 0; i < shape.size(); ++i) want += (i ? ", " : "") + std::to_string(shape[i]);
  want += "]";
  KILN_CHECK(f.contains(name), ValueError, "quant::load_int4: ", file, ": expected tensor '", name, "' (", want,
             "), got none");
  const Tensor& t = f.at(name);
  KILN_CHECK(t.dtype() == dtype && t.sizes() == IntArrayRef(shape), ValueError, "quant::load_int4: ", file,
             ": tensor '", name, "': expected ", want, ", got ", describe(t));
  return t;
}

struct Pending {
  std::string path, parent_path, name;
  std::shared_ptr<Int4Linear> layer;
};

}  // namespace

void save_int4(const nn::Module& model, const std::string& path, io::Metadata metadata) {
  metadata[kQuantizedKey] = kInt4Value;
  io::save_safetensors(path, model.state_dict(), metadata);
}

std::vector<std::string> load_int4(nn::Module& model, const std::string& path) {
  const io::SafetensorsFile f = io::load_safetensors(path);
  const auto mark = f.metadata.find(kQuantizedKey);
  if (mark == f.metadata.end() || mark->second != kInt4Value)
    throw FormatError(concat("quant::load_int4: ", path, ": expected metadata \"", kQuantizedKey, "\" = \"", kInt4Value,
                             "\", got ", mark == f.metadata.end() ? std::string("none") : "\"" + mark->second + "\""));
  auto modules = model.named_modules();
  std::unordered_map<std::string, nn::Module*> by_path(modules.begin(), modules.end());
  std::unordered_map<std::string, size_t> order;
  for (size_t i = 0; i < modules.size(); ++i) order.emplace(modules[i].first, i);

  // 1. Each "<path>.weight_int4": a float Linear the parent lets quant swap, and its tensors.
  const std::string suffix = ".weight_int4";
  std::vector<Pending> pending;
  for (const auto& [key, t] : f.tensors) {
    if (key.size() <= suffix.size() || key.compare(key.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
    Pending p;
    p.path = key.substr(0, key.size() - suffix.size());
    const auto it = by_path.find(p.path);
    auto* lin = it == by_path.end() ? nullptr : dynamic_cast<nn::Linear*>(it->second);
    KILN_CHECK(lin && lin->weight.defined() && lin->weight.dtype() == kFloat32, ValueError, "quant::load_int4: ", path,
               ": tensor '", key, "': expected a float Linear at '", p.path, "' in the model, got ",
               it == by_path.end() ? std::string("no module") : it->second->type_name());
    const size_t dot = p.path.rfind('.');
    p.parent_path = dot == std::string::npos ? "" : p.path.substr(0, dot);
    p.name = dot == std::string::npos ? p.path : p.path.substr(dot + 1);
    KILN_CHECK(detail::swap_int4_member(*by_path.at(p.parent_path), p.name, nullptr), ValueError,
               "quant::load_int4: ", path, ": tensor '", key, "': its layer's parent ",
               by_path.at(p.parent_path)->type_name(), " calls it through a member quant does not know");
    KILN_CHECK(!f.contains(p.path + ".weight"), ValueError, "quant::load_int4: ", path, ": tensor '", p.path,
               ".weight': expected none beside '", key, "' (a layer is int4 or float)");
    const int64_t out = lin->options.out_features, in = lin->options.in_features;
    KILN_CHECK(in % 2 == 0, ValueError, "quant::load_int4: ", path, ": '", p.path, "' has odd in_features ", in);
    const Tensor& packed = expect(f, path, key, kUInt8, {out, in / 2});
    KILN_CHECK(f.contains(p.path + ".weight_scales"), ValueError, "quant::load_int4: ", path, ": expected tensor '",
               p.path, ".weight_scales', got none");
    const Tensor& sc = f.at(p.path + ".weight_scales");
    const int64_t groups = sc.dim() == 2 ? sc.size(1) : 0;
    KILN_CHECK(groups > 0 && in % groups == 0 && (in / groups) % 2 == 0, ValueError, "quant::load_int4: ", path,
               ": tensor '", p.path, ".weight_scales': expected float32 [", out,
               ", in / group_size] with an even group size dividing ", in, ", got ", describe(sc));
    const Tensor scales = expect(f, path, p.path + ".weight_scales", kFloat32, {out, groups}).contiguous();
    const Tensor zeros = expect(f, path, p.path + ".weight_zeros", kUInt8, {out, groups}).contiguous();
    const float* s = scales.data_ptr<float>();
    for (int64_t i = 0; i < scales.numel(); ++i)
      KILN_CHECK(std::isfinite(s[i]) && s[i] > 0, ValueError, "quant::load_int4: ", path, ": tensor '", p.path,
                 ".weight_scales': expected finite scales > 0, got ", s[i], " at [", i / groups, ", ", i % groups, "]");
    const uint8_t* z = zeros.data_ptr<uint8_t>();
    for (int64_t i = 0; i < zeros.numel(); ++i)
      KILN_CHECK(z[i] <= 15, ValueError, "quant::load_int4: ", path, ": tensor '", p.path,
                 ".weight_zeros': expected zero points in [0, 15], got ", static_cast<int>(z[i]), " at [", i / groups,
                 ", ", i % groups, "]");
    Tensor bias;
    if (lin->options.bias)
      bias = expect(f, path, p.path + ".bias", kFloat32, {out});
    else
      KILN_CHECK(!f.contains(p.path + ".bias"), ValueError, "quant::load_int4: ", path, ": tensor '", p.path,
                 ".bias': expected none (the layer has no bias), got one");
    Int4Tensor q;
    q.out = out;
    q.in = in;
    q.group_size = in / groups;
    {
      const NoGradGuard ng;
      q.packed = packed.contiguous().clone();
      q.scales = scales.clone();
      q.zeros = zeros.clone();
    }
    p.layer = std::make_shared<Int4Linear>(*lin, std::move(q), bias);
    pending.push_back(std::move(p));
  }
  std::sort(pending.begin(), pending.end(),
            [&](const Pending& a, const Pending& b) { return order[a.path] < order[b.path]; });

  // 2. The rest of the file against the model as it will be: the same names, dtypes and shapes.
  std::unordered_map<std::string, const Pending*> int4_at;
  for (const Pending& p : pending) int4_at.emplace(p.path, &p);
  std::map<std::string, Tensor> expected;
  for (auto& [name, t] : model.state_dict()) {
    const size_t dot = name.rfind('.');
    if (dot != std::string::npos && int4_at.count(name.substr(0, dot))) continue;
    expected.emplace(name, t);
  }
  for (const Pending& p : pending)
    for (auto& [name, t] : p.layer->state_dict()) expected.emplace(p.path + "." + name, t);
  for (const auto& [name, t] : f.tensors) {
    const auto it = expected.find(name);
    KILN_CHECK(it != expected.end(), ValueError, "quant::load_int4: ", path, ": tensor '", name,
               "': expected only the model's (", model.type_name(), ") tensors, got one it does not have");
    KILN_CHECK(t.dtype() == it->second.dtype() && t.sizes() == it->second.sizes(), ValueError,
               "quant::load_int4: ", path, ": tensor '", name, "': expected ", describe(it->second), ", got ",
               describe(t));
  }
  for (const auto& [name, t] : expected)
    KILN_CHECK(f.contains(name), ValueError, "quant::load_int4: ", path, ": expected tensor '", name, "' (",
               describe(t), "), got none");

  // 3. Nothing can fail from here on.
  std::vector<std::string> paths;
  for (const Pending& p : pending) {
    nn::Module& parent = *by_path.at(p.parent_path);
    detail::swap_int4_member(parent, p.name, p.layer);
    parent.register_module(p.name, p.layer);
    paths.push_back(p.path);
  }
  model.load_state_dict(f.tensors, /*strict=*/true);
  return paths;
}

}  // namespace kiln::quant
