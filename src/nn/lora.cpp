// nn::lora (include/kiln/nn/lora.h): adapters as forward hooks on Linear modules.
//
// Why hooks and not a replacement module: kiln's models keep typed pointers to
// their children (CausalSelfAttention::c_attn is a std::shared_ptr<Linear>) and
// call them directly, so swapping a child in the module tree would not change
// what forward() calls. A forward hook on the Linear itself is seen by every
// caller, and TransformerBlock already leaves its fused residual paths when a
// hook is present, so the adapter's term is never skipped.
#include "kiln/nn/lora.h"

#include <algorithm>
#include <map>
#include <set>
#include <unordered_map>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/io/peft_adapter.h"
#include "kiln/nn/init.h"

namespace kiln::nn::lora {

using kiln::detail::concat;

namespace {

// Component-wise glob: '*' any run of characters, '?' one character, within one component.
bool glob(std::string_view p, std::string_view s) {
  size_t pi = 0, si = 0, star = std::string_view::npos, mark = 0;
  while (si < s.size()) {
    if (pi < p.size() && (p[pi] == '?' || p[pi] == s[si])) {
      ++pi, ++si;
    } else if (pi < p.size() && p[pi] == '*') {
      star = pi++;
      mark = si;
    } else if (star != std::string_view::npos) {
      pi = star + 1;
      si = ++mark;
    } else {
      return false;
    }
  }
  while (pi < p.size() && p[pi] == '*') ++pi;
  return pi == p.size();
}

std::vector<std::string_view> split_dots(std::string_view s) {
  std::vector<std::string_view> out;
  size_t start = 0;
  for (size_t i = 0; i <= s.size(); ++i)
    if (i == s.size() || s[i] == '.') {
      out.push_back(s.substr(start, i - start));
      start = i + 1;
    }
  return out;
}

bool has_glob(std::string_view p) { return p.find_first_of("*?") != std::string_view::npos; }

// A module inside an adapter (".lora_A.", ".lora_B.", ".lora_dropout.") is never itself a target.
bool inside_adapter(const std::string& path) {
  for (const char* c : {"lora_A", "lora_B", "lora_dropout"})
    for (auto part : split_dots(path))
      if (part == c) return true;
  return false;
}

struct Flags {
  std::string active;
  bool merged = false;
  bool enabled = true;
};

struct Adapter {
  std::shared_ptr<Linear> A, B;
  ModulePtr dropout;
  double scaling = 1.0;
};

}  // namespace

struct LayerState {
  std::string path;
  Linear* base = nullptr;
  std::string tied_to;  // the name the base weight is listed under when another module owns it
  std::shared_ptr<ModuleDict> lora_A, lora_B, lora_dropout;
  std::map<std::string, Adapter> adapters;
  std::shared_ptr<Flags> flags;
};

struct Lora::Impl {
  Module* model = nullptr;
  std::vector<std::shared_ptr<LayerState>> layers;  // model order
  std::vector<Options> adapters;                    // insertion order
  std::shared_ptr<Flags> flags = std::make_shared<Flags>();

  const Options* find(const std::string& name) const {
    for (const auto& o : adapters)
      if (o.name == name) return &o;
    return nullptr;
  }
  std::string known() const {
    std::string s;
    for (const auto& o : adapters) s += (s.empty() ? "'" : ", '") + o.name + "'";
    return s.empty() ? "none" : s;
  }
  const std::string& resolve(const std::string& name) const { return name.empty() ? flags->active : name; }
  void require(const std::string& name, const char* what) const {
    KILN_CHECK(find(name) != nullptr, ValueError, "lora: ", what, ": no adapter called '", name, "'; the model has ",
               known());
  }
  void add(const Options& o);
  void set_trainable(const std::string& name);
  // The biases adapter `name`'s Options::bias trains, with their names in the model (model order).
  NamedTensors biases(const std::string& name) const;
};

bool matches(std::string_view pattern, std::string_view path) {
  if (pattern.empty() || path.empty()) return false;
  auto p = split_dots(pattern), s = split_dots(path);
  if (p.size() > s.size()) return false;
  const size_t off = s.size() - p.size();
  for (size_t i = 0; i < p.size(); ++i)
    if (!glob(p[i], s[off + i])) return false;
  return true;
}

NamedTensors trainable_parameters(const Module& model) {
  NamedTensors out;
  for (auto& [n, t] : model.named_parameters())
    if (t.requires_grad()) out.emplace_back(n, t);
  return out;
}

void Lora::Impl::add(const Options& o) {
  KILN_CHECK(!o.targets.empty(), ValueError, "lora: adapter '", o.name, "': expected at least one target, got none");
  KILN_CHECK(o.rank >= 1, ValueError, "lora: adapter '", o.name, "': expected rank >= 1, got ", o.rank);
  KILN_CHECK(o.alpha > 0, ValueError, "lora: adapter '", o.name, "': expected alpha > 0, got ", o.alpha);
  KILN_CHECK(o.dropout >= 0 && o.dropout < 1, ValueError, "lora: adapter '", o.name,
             "': expected dropout in [0, 1), got ", o.dropout);
  KILN_CHECK(!o.name.empty() && o.name.find('.') == std::string::npos, ValueError,
             "lora: expected an adapter name without dots, got '", o.name, "'");
  KILN_CHECK(find(o.name) == nullptr, ValueError, "lora: the model already has an adapter called '", o.name, "'");
  KILN_CHECK(o.bias == "none" || o.bias == "all" || o.bias == "lora_only", ValueError, "lora: adapter '", o.name,
             "': expected bias \"none\", \"all\" or \"lora_only\", got \"", o.bias, "\"");

  // Where each parameter is listed: a Linear whose weight is listed under another
  // name shares it (GPT's lm_head with wte), and merging into it would change both.
  std::unordered_map<const TensorImpl*, std::string> param_names;
  for (auto& [n, t] : model->named_parameters()) param_names.emplace(t.impl(), n);

  std::vector<std::pair<std::string, Linear*>> chosen;
  std::vector<std::string> errors;
  for (const auto& pattern : o.targets) {
    bool any = false, named_other = false;
    for (auto& [path, m] : model->named_modules()) {
      if (path.empty() || inside_adapter(path) || !matches(pattern, path)) continue;
      auto* lin = dynamic_cast<Linear*>(m);
      if (!lin) {
        if (!has_glob(pattern)) {
          errors.push_back(concat("target '", pattern, "' names '", path, "', a ", m->type_name(), ", not a Linear"));
          named_other = true;
        }
        continue;
      }
      any = true;
      if (std::none_of(chosen.begin(), chosen.end(), [&](auto& c) { return c.second == lin; }))
        chosen.emplace_back(path, lin);
    }
    if (!any && !named_other) errors.push_back(concat("target '", pattern, "' matches no Linear module"));
  }
  if (!errors.empty()) {
    std::string linears;
    for (auto& [path, m] : model->named_modules())
      if (!path.empty() && !inside_adapter(path) && dynamic_cast<Linear*>(m)) linears += "\n  " + path;
    std::string msg = "lora: adapter '" + o.name + "':";
    for (auto& e : errors) msg += "\n  " + e;
    throw ValueError(msg + "\nthe model's Linear modules are:" + (linears.empty() ? " none" : linears));
  }
  // Model order, whatever the order of the patterns.
  std::map<Module*, size_t> order;
  for (auto& [path, m] : model->named_modules()) order.emplace(m, order.size());
  std::sort(chosen.begin(), chosen.end(), [&](auto& a, auto& b) { return order[a.second] < order[b.second]; });

  for (auto& [path, lin] : chosen) {
    std::shared_ptr<LayerState> st;
    for (auto& l : layers)
      if (l->base == lin) st = l;
    if (!st) {
      for (auto& c : lin->named_children())
        KILN_CHECK(c.first != "lora_A", ValueError, "lora: '", path,
                   "' already carries adapters of another nn::lora::apply; add adapters through that handle");
      st = std::make_shared<LayerState>();
      st->path = path;
      st->base = lin;
      st->flags = flags;
      if (lin->weight.defined()) {
        auto it = param_names.find(lin->weight.impl());
        if (it != param_names.end() && it->second != path + ".weight") st->tied_to = it->second;
      }
      st->lora_A = lin->register_module("lora_A", std::make_shared<ModuleDict>());
      st->lora_B = lin->register_module("lora_B", std::make_shared<ModuleDict>());
      st->lora_dropout = lin->register_module("lora_dropout", std::make_shared<ModuleDict>());
      // The hook holds the layer's state, not the handle: the adapters keep
      // working (and switching through any copy of the handle) however long the model lives.
      LayerState* raw = st.get();
      std::shared_ptr<LayerState> keep = st;
      lin->register_forward_hook(
          [keep, raw](Module&, const Tensor& x, const Tensor& y) -> Tensor {
            const Flags& f = *raw->flags;
            if (!f.enabled || f.merged) return Tensor();
            auto it = raw->adapters.find(f.active);
            if (it == raw->adapters.end()) return Tensor();
            const Adapter& a = it->second;
            // PEFT's order of operations: result + lora_B(lora_A(dropout(x))) * scaling.
            return y + (*a.B)((*a.A)((*a.dropout)(x))).mul(a.scaling);
          },
          Module::HookReplay::TensorOpsOnly);
      layers.push_back(st);
    }
    const int64_t in = lin->options.in_features, out = lin->options.out_features;
    const std::optional<DType> dt = lin->weight.defined() && is_floating_point(lin->weight.dtype())
                                        ? std::optional<DType>(lin->weight.dtype())
                                        : lin->options.dtype;
    Adapter a;
    // Linear's own initialisation draws A Kaiming-uniform with a = sqrt(5) (as PEFT's
    // init of lora_A); B starts at zeros so that B·A = 0 and the model is unchanged.
    a.A =
        std::make_shared<Linear>(LinearOptions{.in_features = in, .out_features = o.rank, .bias = false, .dtype = dt});
    a.B =
        std::make_shared<Linear>(LinearOptions{.in_features = o.rank, .out_features = out, .bias = false, .dtype = dt});
    init::zeros_(a.B->weight);
    a.dropout = o.dropout > 0 ? ModulePtr(std::make_shared<Dropout>(o.dropout)) : std::make_shared<Identity>();
    a.scaling = o.alpha / static_cast<double>(o.rank);
    a.dropout->train(lin->is_training());
    st->lora_A->insert(o.name, a.A);
    st->lora_B->insert(o.name, a.B);
    st->lora_dropout->insert(o.name, a.dropout);
    st->adapters.emplace(o.name, a);
  }
  // Model order of the layer list (a later adapter may wrap layers before earlier ones).
  std::sort(layers.begin(), layers.end(), [&](auto& a, auto& b) { return order[a->base] < order[b->base]; });
  adapters.push_back(o);
}

namespace {
// The parameters of `model` that bias mode `bias` trains when the adapter wraps the modules `wrapped`.
NamedTensors bias_parameters(const Module& model, const std::string& bias, const std::vector<std::string>& wrapped) {
  NamedTensors out;
  if (bias == "none") return out;
  std::set<std::string> own;
  for (auto& p : wrapped) own.insert(p + ".bias");
  for (auto& [n, t] : model.named_parameters()) {
    if (inside_adapter(n)) continue;
    const bool is_bias = n == "bias" || (n.size() > 5 && n.compare(n.size() - 5, 5, ".bias") == 0);
    if (is_bias && (bias == "all" || own.count(n))) out.emplace_back(n, t);
  }
  return out;
}
}  // namespace

NamedTensors Lora::Impl::biases(const std::string& name) const {
  const Options* o = find(name);
  if (!o || o->bias == "none") return {};
  std::vector<std::string> wrapped;
  for (auto& l : layers)
    if (l->adapters.count(name)) wrapped.push_back(l->path);
  return bias_parameters(*model, o->bias, wrapped);
}

void Lora::Impl::set_trainable(const std::string& name) {
  for (auto& l : layers)
    for (auto& [n, a] : l->adapters) {
      a.A->weight.requires_grad_(n == name);
      a.B->weight.requires_grad_(n == name);
    }
  // Biases are shared by every adapter: freeze those any adapter trains, then
  // open the active one's.
  for (const auto& o : adapters)
    for (auto& [n, t] : biases(o.name)) t.requires_grad_(false);
  for (auto& [n, t] : biases(name)) t.requires_grad_(true);
}

Lora apply(Module& model, const Options& options) {
  auto impl = std::make_shared<Lora::Impl>();
  impl->model = &model;
  impl->add(options);
  for (auto& p : model.parameters()) p.requires_grad_(false);
  impl->flags->active = options.name;
  impl->set_trainable(options.name);
  return Lora(impl);
}

void Lora::add_adapter(const Options& options) {
  impl_->add(options);
  impl_->set_trainable(impl_->flags->active);
}

void Lora::set_adapter(const std::string& name) {
  impl_->require(name, "set_adapter");
  KILN_CHECK(!impl_->flags->merged, ValueError, "lora: set_adapter('", name, "'): adapter '", impl_->flags->active,
             "' is merged into the base weights; unmerge() first");
  impl_->flags->active = name;
  impl_->set_trainable(name);
}

const std::string& Lora::active_adapter() const { return impl_->flags->active; }

std::vector<std::string> Lora::adapter_names() const {
  std::vector<std::string> out;
  for (const auto& o : impl_->adapters) out.push_back(o.name);
  return out;
}

const Options& Lora::options(const std::string& name) const {
  impl_->require(name, "options");
  return *impl_->find(name);
}

namespace {
// B·A·scaling in the base weight's dtype.
Tensor delta_weight(const Adapter& a, DType dt) { return a.B->weight.matmul(a.A->weight).mul(a.scaling).to(dt); }
}  // namespace

void Lora::merge() {
  Flags& f = *impl_->flags;
  KILN_CHECK(!f.merged, ValueError, "lora: merge(): adapter '", f.active, "' is already merged");
  std::string problems;
  for (auto& l : impl_->layers) {
    if (!l->adapters.count(f.active)) continue;
    if (!l->tied_to.empty())
      problems +=
          concat("\n  '", l->path, "': its weight is tied to '", l->tied_to, "'; merging would change that module too");
    else if (!l->base->weight.defined() || !is_floating_point(l->base->weight.dtype()))
      problems += concat("\n  '", l->path,
                         "': its base has no float weight (a quantized base); merging would need to re-quantize");
  }
  KILN_CHECK(problems.empty(), ValueError, "lora: merge() of adapter '", f.active, "' refused:", problems);
  NoGradGuard g;
  for (auto& l : impl_->layers) {
    auto it = l->adapters.find(f.active);
    if (it != l->adapters.end()) l->base->weight.add_(delta_weight(it->second, l->base->weight.dtype()));
  }
  f.merged = true;
}

void Lora::unmerge() {
  Flags& f = *impl_->flags;
  KILN_CHECK(f.merged, ValueError, "lora: unmerge(): no adapter is merged");
  NoGradGuard g;
  for (auto& l : impl_->layers) {
    auto it = l->adapters.find(f.active);
    if (it != l->adapters.end()) l->base->weight.sub_(delta_weight(it->second, l->base->weight.dtype()));
  }
  f.merged = false;
}

bool Lora::merged() const { return impl_->flags->merged; }
void Lora::set_enabled(bool on) { impl_->flags->enabled = on; }

std::vector<std::string> Lora::target_paths() const {
  std::vector<std::string> out;
  for (auto& l : impl_->layers) out.push_back(l->path);
  return out;
}

NamedTensors Lora::trainable_parameters() const {
  NamedTensors out;
  const std::string& name = impl_->flags->active;
  for (auto& l : impl_->layers) {
    auto it = l->adapters.find(name);
    if (it == l->adapters.end()) continue;
    out.emplace_back(l->path + ".lora_A." + name + ".weight", it->second.A->weight);
    out.emplace_back(l->path + ".lora_B." + name + ".weight", it->second.B->weight);
  }
  for (auto& nt : impl_->biases(name)) out.push_back(nt);
  return out;
}

int64_t Lora::num_parameters(const std::string& name) const {
  const std::string& n = impl_->resolve(name);
  impl_->require(n, "num_parameters");
  int64_t total = 0;
  for (auto& l : impl_->layers) {
    auto it = l->adapters.find(n);
    if (it != l->adapters.end()) total += it->second.A->weight.numel() + it->second.B->weight.numel();
  }
  for (auto& [bn, t] : impl_->biases(n)) total += t.numel();
  return total;
}

NamedTensors Lora::adapter_state_dict(const std::string& name) const {
  const std::string& n = impl_->resolve(name);
  impl_->require(n, "adapter_state_dict");
  NamedTensors out;
  for (auto& l : impl_->layers) {
    auto it = l->adapters.find(n);
    if (it == l->adapters.end()) continue;
    out.emplace_back(io::peft_lora_key(l->path, 'A'), it->second.A->weight.detach());
    out.emplace_back(io::peft_lora_key(l->path, 'B'), it->second.B->weight.detach());
  }
  for (auto& [bn, t] : impl_->biases(n)) out.emplace_back("base_model.model." + bn, t.detach());
  return out;
}

void Lora::load_adapter_state_dict(const NamedTensors& tensors, const std::string& name) {
  const std::string& n = impl_->resolve(name);
  impl_->require(n, "load_adapter_state_dict");
  KILN_CHECK(!(impl_->flags->merged && n == impl_->flags->active), ValueError,
             "lora: load_adapter_state_dict: adapter '", n, "' is merged into the base weights; unmerge() first");
  std::map<std::string, Tensor*> expected;
  for (auto& l : impl_->layers) {
    auto it = l->adapters.find(n);
    if (it == l->adapters.end()) continue;
    expected.emplace(io::peft_lora_key(l->path, 'A'), &it->second.A->weight);
    expected.emplace(io::peft_lora_key(l->path, 'B'), &it->second.B->weight);
  }
  // The model's bias tensors are handles on its storage: copy_ into them writes the model's biases.
  NamedTensors bias_params = impl_->biases(n);
  for (auto& [bn, t] : bias_params) expected.emplace("base_model.model." + bn, &t);
  std::string problems;
  std::set<std::string> given;
  for (auto& [key, t] : tensors) {
    given.insert(key);
    auto it = expected.find(key);
    if (it == expected.end()) {
      problems += concat("\n  unexpected '", key, "': adapter '", n, "' has no such module");
    } else if (t.shape() != it->second->shape()) {
      problems += concat("\n  '", key, "': expected shape ", it->second->shape_string(), ", got ", t.shape_string());
    } else if (!is_floating_point(t.dtype())) {
      problems += concat("\n  '", key, "': expected a floating-point tensor, got ", dtype_name(t.dtype()));
    }
  }
  for (auto& [key, p] : expected)
    if (!given.count(key)) problems += concat("\n  missing '", key, "'");
  KILN_CHECK(problems.empty(), ValueError, "lora: cannot load adapter '", n, "':", problems);
  NoGradGuard g;
  for (auto& [key, t] : tensors) expected.at(key)->copy_(t);
}

void Lora::save(const std::string& dir, const std::string& name) const {
  const std::string& n = impl_->resolve(name);
  const Options& o = options(n);
  io::PeftAdapter a;
  a.config.r = o.rank;
  a.config.lora_alpha = o.alpha;
  a.config.lora_dropout = o.dropout;
  a.config.bias = o.bias;
  for (auto& l : impl_->layers)
    if (l->adapters.count(n)) a.config.target_modules.push_back(l->path);
  a.tensors = adapter_state_dict(n);
  io::save_peft_adapter(dir, a);
}

void Lora::load(const std::string& dir, const std::string& name) {
  KILN_CHECK(impl_->find(name) == nullptr, ValueError, "lora: load('", dir,
             "'): the model already has an adapter called '", name, "'");
  KILN_CHECK(!impl_->flags->merged, ValueError, "lora: load('", dir, "'): adapter '", impl_->flags->active,
             "' is merged into the base weights; unmerge() first");
  io::PeftAdapter a = io::load_peft_adapter(dir);
  // Check the file against the model before adding anything: each module the
  // file names must be a Linear of the model with the file's shapes.
  std::map<std::string, Module*> modules;
  for (auto& [path, m] : impl_->model->named_modules())
    if (!path.empty() && !inside_adapter(path)) modules.emplace(path, m);
  std::string problems;
  std::vector<std::string> paths;
  std::map<std::string, Tensor> params;
  for (auto& [n, t] : impl_->model->named_parameters()) params.emplace(n, t);
  std::vector<const std::string*> bias_keys;
  for (auto& [key, t] : a.tensors) {
    char which = 0;
    const std::string path = io::peft_lora_module(key, &which);
    if (path.empty()) {  // a trained bias (the reader admits these only when the config's bias is not "none")
      bias_keys.push_back(&key);
      const std::string bn = io::peft_bias_parameter(key);
      auto p = params.find(bn);
      if (p == params.end())
        problems += concat("\n  '", key, "': the model has no parameter '", bn, "'");
      else if (t.shape() != p->second.shape())
        problems += concat("\n  '", key, "': expected shape ", p->second.shape_string(), " for the model's '", bn,
                           "', got ", t.shape_string());
      continue;
    }
    auto it = modules.find(path);
    if (it == modules.end()) {
      if (which == 'A') problems += concat("\n  target '", path, "': the model has no such module");
      continue;
    }
    auto* lin = dynamic_cast<Linear*>(it->second);
    if (!lin) {
      if (which == 'A')
        problems += concat("\n  target '", path, "': expected a Linear, the model has a ", it->second->type_name());
      continue;
    }
    const std::vector<int64_t> want = which == 'A' ? std::vector<int64_t>{a.config.r, lin->options.in_features}
                                                   : std::vector<int64_t>{lin->options.out_features, a.config.r};
    if (t.shape() != want)
      problems += concat("\n  '", key, "': expected shape [", want[0], ", ", want[1], "] for the model's Linear(",
                         lin->options.in_features, ", ", lin->options.out_features, "), got ", t.shape_string());
    if (which == 'A') paths.push_back(path);
  }
  // The biases the file's bias mode trains on this model are exactly the ones it must carry.
  std::set<std::string> want;
  for (auto& [bn, t] : bias_parameters(*impl_->model, a.config.bias, paths)) want.insert(bn);
  for (const std::string* key : bias_keys) {
    const std::string bn = io::peft_bias_parameter(*key);
    if (params.count(bn) && !want.erase(bn))
      problems += concat("\n  '", *key, "': bias = \"", a.config.bias, "\" does not train that parameter here");
  }
  for (auto& bn : want)
    problems += concat("\n  missing 'base_model.model.", bn, "': bias = \"", a.config.bias,
                       "\" trains that parameter of this model");
  for (auto& target : a.config.target_modules)
    if (std::none_of(paths.begin(), paths.end(), [&](const std::string& p) { return matches(target, p); }))
      problems += concat("\n  target_modules entry '", target, "': the file holds no tensors for a module it names");
  KILN_CHECK(problems.empty(), ValueError, "lora: cannot load adapter '", dir, "' into this model:", problems);
  add_adapter({.targets = paths,
               .rank = a.config.r,
               .alpha = a.config.lora_alpha,
               .dropout = a.config.lora_dropout,
               .name = name,
               .bias = a.config.bias});
  load_adapter_state_dict(a.tensors, name);
  set_adapter(name);
}

}  // namespace kiln::nn::lora
