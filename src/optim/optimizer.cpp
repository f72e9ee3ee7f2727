// Optimizer base (param groups, name-keyed state, state_dict) and SGD, Adam,
// AdamW, RMSprop over the fused kernels of kernels.h.
#include "kiln/optim/optimizer.h"

#include <cmath>
#include <functional>
#include <limits>
#include <set>
#include <sstream>

#include "kernels.h"
#include "kiln/core/allocator.h"
#include "kiln/core/capture.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/core/parallel.h"
#include "kiln/core/record.h"
#include "kiln/core/threads.h"
#include "kiln/ops/factory.h"

namespace kiln::optim {

namespace {

void check_range(const std::string& opt, const HyperParams& hp, const std::string& key, double lo, bool lo_incl,
                 double hi, bool hi_incl) {
  const double v = hp.at(key);
  const bool ok = (lo_incl ? v >= lo : v > lo) && (hi_incl ? v <= hi : v < hi) && !std::isnan(v);
  KILN_CHECK(ok, ValueError, opt, ": invalid ", key, ": expected a value in ", lo_incl ? "[" : "(", lo, ", ", hi,
             hi_incl ? "]" : ")", ", got ", v);
}

// The event names torch's profiler gives optimizers ("Optimizer.step#AdamW.step"),
// built only while recording; the caller keeps the string alive for the scope it names.
std::string optimizer_event(const char* method, const std::string& optimizer) {
  return record::active() ? "Optimizer." + std::string(method) + "#" + optimizer + "." + method : std::string();
}

void check_nonneg(const std::string& opt, const HyperParams& hp, const std::string& key) {
  check_range(opt, hp, key, 0, true, std::numeric_limits<double>::infinity(), true);
}

Tensor state_zeros(const Tensor& p) {
  MemoryCategoryGuard guard(MemoryCategory::OptimizerState);
  return zeros(p.sizes(), TensorOptions(p.dtype()));
}

Tensor state_clone(const Tensor& t) {
  MemoryCategoryGuard guard(MemoryCategory::OptimizerState);
  NoGradGuard no_grad;
  return t.detach().clone();
}

// The dtypes the update kernels take (add_param_group checks the parameters').
constexpr DTypeSet kOptimTypes{kFloat32, kFloat64};

template <typename T>
T* at(T* p, int64_t offset) {
  return p ? p + offset : nullptr;
}

// Runs fn(begin, end) over [0, n) in chunks on kiln's threads (elementwise
// updates: the result does not depend on the split).
template <typename Fn>
void chunked(int64_t n, Fn&& fn) {
  if (n < kGrainSize)
    fn(int64_t{0}, n);
  else
    ::kiln::parallel_for(n, kGrainSize, [&](int64_t b, int64_t e) { fn(b, e); });
}

}  // namespace

void Optimizer::init_groups(NamedParams params) { add_param_group(ParamGroup{std::move(params), {}}); }

namespace {
const char* kRegisterHint =
    "hint: a tensor becomes a parameter through register_parameter(name, tensor), and a member module "
    "contributes its parameters only once passed to register_module(name, module)";
}

void Optimizer::require_parameters() const {
  for (const auto& g : groups_)
    if (!g.params.empty()) return;
  KILN_CHECK(false, ValueError, name_, ": optimizer got an empty parameter list (", groups_.size(),
             " param groups, none with a parameter); expected at least one parameter. If the list came from "
             "module.named_parameters(), the module registered none: ",
             kRegisterHint);
}

NamedParams Optimizer::module_parameters(const nn::Module& model, const std::string& optimizer) {
  NamedParams params = model.named_parameters();
  if (!params.empty()) return params;
  // Every module of the tree, to show which ones were expected to hold parameters.
  std::vector<std::string> mods;
  std::function<void(const nn::Module&, const std::string&)> walk = [&](const nn::Module& m, const std::string& path) {
    mods.push_back((path.empty() ? std::string("(root)") : "'" + path + "'") + " " + m.type_name());
    for (const auto& [n, c] : m.named_children()) walk(*c, path.empty() ? n : path + "." + n);
  };
  walk(model, "");
  std::string list;
  for (size_t i = 0; i < mods.size() && i < 12; ++i) list += (i ? ", " : "") + mods[i];
  if (mods.size() > 12) list += ", ... (" + std::to_string(mods.size() - 12) + " more)";
  KILN_CHECK(false, ValueError, optimizer, ": optimizer got an empty parameter list: the module ", model.type_name(),
             " holds no registered parameters, in any of its ", mods.size(), " module(s): ", list, ". ",
             mods.size() == 1 ? "It has no registered submodules either. " : "", kRegisterHint);
  return params;
}

void Optimizer::add_param_group(ParamGroup group) {
  for (const auto& [k, v] : group.options) {
    KILN_CHECK(defaults_.count(k), ValueError, name_, ": unknown hyperparameter '", k, "' in a param group (got value ",
               v, ")");
  }
  for (const auto& [k, v] : defaults_) group.options.emplace(k, v);
  validate(group.options);
  std::set<std::string> seen;
  std::map<const void*, std::string> tensors;  // TensorImpl -> name
  for (const auto& g : groups_)
    for (const auto& [n, p] : g.params) {
      seen.insert(n);
      tensors.emplace(p.impl(), n);
    }
  for (const auto& [n, p] : group.params) {
    KILN_CHECK(p.defined(), ValueError, name_, ": parameter '", n, "' is an undefined tensor");
    KILN_CHECK(seen.insert(n).second, ValueError, name_, ": parameter name '", n,
               "' appears in more than one place; expected each parameter once");
    auto [it, fresh] = tensors.emplace(p.impl(), n);
    KILN_CHECK(fresh, ValueError, name_, ": parameter '", n, "' is the same tensor as parameter '", it->second,
               "'; expected each parameter once");
    KILN_CHECK(p.dtype() == kFloat32 || p.dtype() == kFloat64, ValueError, name_, ": parameter '", n,
               "': expected float32 or float64, got ", dtype_name(p.dtype()));
    KILN_CHECK(p.is_leaf(), ValueError, name_, ": parameter '", n, "' must be a leaf tensor, got one with a grad_fn");
  }
  groups_.push_back(std::move(group));
}

void Optimizer::zero_grad(bool set_to_none) {
  const capture::HostAction host("Optimizer.zero_grad", [this, set_to_none] { zero_grad(set_to_none); });
  const std::string event = optimizer_event("zero_grad", name_);
  const record::Scope rs(record::Kind::Optimizer, event);
  NoGradGuard no_grad;
  for (auto& g : groups_)
    for (auto& [n, p] : g.params) {
      capture::note_grad_reset(p);
      Tensor& grad = p.mutable_grad();
      if (!grad.defined()) continue;
      if (set_to_none) {
        grad = Tensor();
      } else {  // as torch: a gradient with history (create_graph) is detached first
        if (grad.grad_fn())
          grad.detach_();
        else if (grad.requires_grad())
          grad.requires_grad_(false);
        grad.zero_();
      }
    }
}

void Optimizer::step() {
  // Replay runs the whole step again: its step counters and learning rates are host state.
  const capture::HostAction host("Optimizer.step", [this] { step(); });
  const std::string event = optimizer_event("step", name_);
  const record::Scope rs(record::Kind::Optimizer, event);
  NoGradGuard no_grad;
  for (auto& g : groups_) {
    for (auto& [n, p] : g.params) {
      const Tensor& grad = p.grad();
      if (!grad.defined()) continue;
      KILN_CHECK(grad.sizes() == p.sizes() && grad.dtype() == p.dtype(), ValueError, name_, ": parameter '", n,
                 "': expected a gradient of shape ", p.shape_string(), " and dtype ", dtype_name(p.dtype()), ", got ",
                 grad.shape_string(), " ", dtype_name(grad.dtype()));
      ParamState& st = state_[n];
      st.step += 1;
      Tensor gc = grad.is_contiguous() ? grad : grad.contiguous();
      if (p.is_contiguous()) {
        update(p, gc, st, g.options);
      } else {
        Tensor pc = p.contiguous();
        update(pc, gc, st, g.options);
        p.copy_(pc);
      }
      p.bump_version();
    }
  }
  ++step_count_;
}

OptimizerStateDict Optimizer::state_dict() const {
  OptimizerStateDict sd;
  for (const auto& g : groups_) {
    OptimizerStateDict::Group sg;
    for (const auto& [n, _] : g.params) sg.param_names.push_back(n);
    sg.options = g.options;
    sd.param_groups.push_back(std::move(sg));
  }
  for (const auto& [n, st] : state_) {
    ParamState c;
    c.step = st.step;
    for (const auto& [k, t] : st.tensors) c.tensors[k] = state_clone(t);
    sd.state[n] = std::move(c);
  }
  return sd;
}

void Optimizer::load_state_dict(const OptimizerStateDict& sd) {
  std::vector<std::string> problems;
  std::map<std::string, const Tensor*> params;
  for (const auto& g : groups_)
    for (const auto& [n, p] : g.params) params[n] = &p;
  if (sd.param_groups.size() != groups_.size()) {
    problems.push_back(detail::concat("expected ", groups_.size(), " param groups, got ", sd.param_groups.size()));
  } else {
    for (size_t i = 0; i < groups_.size(); ++i) {
      std::vector<std::string> mine;
      for (const auto& [n, _] : groups_[i].params) mine.push_back(n);
      if (mine != sd.param_groups[i].param_names) {
        std::ostringstream os;
        os << "param group " << i << ": expected parameters [";
        for (size_t k = 0; k < mine.size(); ++k) os << (k ? ", " : "") << mine[k];
        os << "], got [";
        for (size_t k = 0; k < sd.param_groups[i].param_names.size(); ++k)
          os << (k ? ", " : "") << sd.param_groups[i].param_names[k];
        os << "]";
        problems.push_back(os.str());
      }
      for (const auto& [k, v] : sd.param_groups[i].options)
        if (!defaults_.count(k) && k != "initial_lr" && k != "max_lr" && k != "min_lr" && k != "max_momentum" &&
            k != "base_momentum")
          problems.push_back(detail::concat("param group ", i, ": unknown hyperparameter '", k, "'"));
    }
  }
  for (const auto& [n, st] : sd.state) {
    auto it = params.find(n);
    if (it == params.end()) {
      problems.push_back(detail::concat("state for '", n, "', which is not a parameter of this optimizer"));
      continue;
    }
    const Tensor& p = *it->second;
    for (const auto& [k, t] : st.tensors) {
      if (!t.defined() || t.sizes() != p.sizes() || t.dtype() != p.dtype())
        problems.push_back(detail::concat(
            "state '", n, ".", k, "': expected shape ", p.shape_string(), " ", dtype_name(p.dtype()), ", got ",
            t.defined() ? t.shape_string() + " " + std::string(dtype_name(t.dtype())) : "undefined"));
    }
  }
  if (!problems.empty()) {
    std::ostringstream os;
    os << name_ << ".load_state_dict: " << problems.size() << " mismatch(es):";
    for (const auto& s : problems) os << "\n  " << s;
    throw ValueError(os.str());
  }
  for (size_t i = 0; i < groups_.size(); ++i) groups_[i].options = sd.param_groups[i].options;
  state_.clear();
  for (const auto& [n, st] : sd.state) {
    ParamState c;
    c.step = st.step;
    for (const auto& [k, t] : st.tensors) c.tensors[k] = state_clone(t);
    state_[n] = std::move(c);
  }
}

// ---- SGD ----

SGD::SGD(NamedParams params, SGDOptions o) : SGD(std::vector<ParamGroup>{ParamGroup{std::move(params), {}}}, o) {}

SGD::SGD(const nn::Module& model, SGDOptions o) : SGD(module_parameters(model, "SGD"), o) {}

SGD::SGD(std::vector<ParamGroup> groups, SGDOptions o)
    : Optimizer({{"lr", o.lr},
                 {"momentum", o.momentum},
                 {"dampening", o.dampening},
                 {"weight_decay", o.weight_decay},
                 {"nesterov", o.nesterov ? 1.0 : 0.0}},
                "SGD") {
  validate(defaults_);
  for (auto& g : groups) add_param_group(std::move(g));
  require_parameters();
}

void SGD::validate(const HyperParams& hp) const {
  check_nonneg(name_, hp, "lr");
  check_nonneg(name_, hp, "momentum");
  check_nonneg(name_, hp, "weight_decay");
  check_range(name_, hp, "dampening", -std::numeric_limits<double>::infinity(), true,
              std::numeric_limits<double>::infinity(), true);
  if (hp.at("nesterov") != 0) {
    KILN_CHECK(hp.at("momentum") > 0 && hp.at("dampening") == 0, ValueError,
               "SGD: nesterov momentum requires momentum > 0 and dampening == 0, got momentum=", hp.at("momentum"),
               ", dampening=", hp.at("dampening"));
  }
}

// The updates read each hyperparameter and state tensor once per parameter,
// not once per chunk: a string-keyed lookup costs about what a small
// parameter's whole update does (the tiny MLP's replayed step spent 6-10 %
// of its time in them and the step loop around them).

namespace {
// A state tensor of p, made (zeros) on first use; `made` (if given) says whether it was.
Tensor& state_tensor(ParamState& st, const char* name, const Tensor& p, bool* made = nullptr) {
  auto [it, inserted] = st.tensors.try_emplace(name);
  if (inserted) it->second = state_zeros(p);
  if (made) *made = inserted;
  return it->second;
}
}  // namespace

void SGD::update(Tensor& p, const Tensor& g, ParamState& st, const HyperParams& hp) {
  const double momentum = hp.at("momentum"), lr = hp.at("lr"), dampening = hp.at("dampening"),
               weight_decay = hp.at("weight_decay");
  const bool nesterov = hp.at("nesterov") != 0;
  bool first = false;
  Tensor buf;
  if (momentum != 0) buf = state_tensor(st, "momentum_buffer", p, &first);
  visit_dtype<kOptimTypes>(p.dtype(), name_, [&]<typename T>() {
    T *pp = p.data_ptr<T>(), *bp = buf.defined() ? buf.data_ptr<T>() : nullptr;
    const T* gp = g.data_ptr<T>();
    chunked(p.numel(), [&](int64_t b, int64_t e) {
      kernels::sgd<T>(pp + b, gp + b, at(bp, b), e - b, lr, momentum, dampening, weight_decay, nesterov, first);
    });
  });
}

// ---- Adam / AdamW ----

Adam::Adam(NamedParams params, AdamOptions o) : Adam(std::vector<ParamGroup>{ParamGroup{std::move(params), {}}}, o) {}

Adam::Adam(std::vector<ParamGroup> groups, AdamOptions o)
    : Optimizer({{"lr", o.lr},
                 {"beta1", o.beta1},
                 {"beta2", o.beta2},
                 {"eps", o.eps},
                 {"weight_decay", o.weight_decay},
                 {"amsgrad", o.amsgrad ? 1.0 : 0.0}},
                "Adam") {
  validate(defaults_);
  for (auto& g : groups) add_param_group(std::move(g));
  require_parameters();
}

Adam::Adam(const nn::Module& model, AdamOptions o) : Adam(module_parameters(model, "Adam"), o) {}

AdamW::AdamW(const nn::Module& model, AdamWOptions o) : AdamW(module_parameters(model, "AdamW"), o) {}

AdamW::AdamW(NamedParams params, AdamWOptions o)
    : AdamW(std::vector<ParamGroup>{ParamGroup{std::move(params), {}}}, o) {}

AdamW::AdamW(std::vector<ParamGroup> groups, AdamWOptions o)
    : Adam(HyperParams{{"lr", o.lr},
                       {"beta1", o.beta1},
                       {"beta2", o.beta2},
                       {"eps", o.eps},
                       {"weight_decay", o.weight_decay},
                       {"amsgrad", o.amsgrad ? 1.0 : 0.0}},
           "AdamW") {
  decoupled_ = true;
  validate(defaults_);
  for (auto& g : groups) add_param_group(std::move(g));
  require_parameters();
}

void Adam::validate(const HyperParams& hp) const {
  check_nonneg(name_, hp, "lr");
  check_nonneg(name_, hp, "eps");
  check_range(name_, hp, "beta1", 0, true, 1, false);
  check_range(name_, hp, "beta2", 0, true, 1, false);
  check_nonneg(name_, hp, "weight_decay");
}

void Adam::update(Tensor& p, const Tensor& g, ParamState& st, const HyperParams& hp) {
  const bool amsgrad = hp.at("amsgrad") != 0;
  const double lr = hp.at("lr"), beta1 = hp.at("beta1"), beta2 = hp.at("beta2"), eps = hp.at("eps"),
               weight_decay = hp.at("weight_decay");
  Tensor& exp_avg = state_tensor(st, "exp_avg", p);
  Tensor& exp_avg_sq = state_tensor(st, "exp_avg_sq", p);
  Tensor* max_sq = amsgrad ? &state_tensor(st, "max_exp_avg_sq", p) : nullptr;
  visit_dtype<kOptimTypes>(p.dtype(), name_, [&]<typename T>() {
    T *pp = p.data_ptr<T>(), *m = exp_avg.data_ptr<T>(), *v = exp_avg_sq.data_ptr<T>();
    T* vmax = max_sq ? max_sq->data_ptr<T>() : nullptr;
    const T* gp = g.data_ptr<T>();
    chunked(p.numel(), [&](int64_t b, int64_t e) {
      kernels::adam<T>(pp + b, gp + b, m + b, v + b, at(vmax, b), e - b, st.step, lr, beta1, beta2, eps, weight_decay,
                       decoupled_);
    });
  });
}

// ---- RMSprop ----

RMSprop::RMSprop(NamedParams params, RMSpropOptions o)
    : RMSprop(std::vector<ParamGroup>{ParamGroup{std::move(params), {}}}, o) {}

RMSprop::RMSprop(const nn::Module& model, RMSpropOptions o) : RMSprop(module_parameters(model, "RMSprop"), o) {}

RMSprop::RMSprop(std::vector<ParamGroup> groups, RMSpropOptions o)
    : Optimizer({{"lr", o.lr},
                 {"alpha", o.alpha},
                 {"eps", o.eps},
                 {"weight_decay", o.weight_decay},
                 {"momentum", o.momentum},
                 {"centered", o.centered ? 1.0 : 0.0}},
                "RMSprop") {
  validate(defaults_);
  for (auto& g : groups) add_param_group(std::move(g));
  require_parameters();
}

void RMSprop::validate(const HyperParams& hp) const {
  for (const char* k : {"lr", "alpha", "eps", "weight_decay", "momentum"}) check_nonneg(name_, hp, k);
}

void RMSprop::update(Tensor& p, const Tensor& g, ParamState& st, const HyperParams& hp) {
  const bool centered = hp.at("centered") != 0;
  const double momentum = hp.at("momentum"), lr = hp.at("lr"), alpha = hp.at("alpha"), eps = hp.at("eps"),
               weight_decay = hp.at("weight_decay");
  Tensor& square_avg = state_tensor(st, "square_avg", p);
  Tensor* momentum_buffer = momentum > 0 ? &state_tensor(st, "momentum_buffer", p) : nullptr;
  Tensor* grad_avg = centered ? &state_tensor(st, "grad_avg", p) : nullptr;
  visit_dtype<kOptimTypes>(p.dtype(), name_, [&]<typename T>() {
    T *pp = p.data_ptr<T>(), *sq = square_avg.data_ptr<T>();
    T* gavg = grad_avg ? grad_avg->data_ptr<T>() : nullptr;
    T* buf = momentum_buffer ? momentum_buffer->data_ptr<T>() : nullptr;
    const T* gp = g.data_ptr<T>();
    chunked(p.numel(), [&](int64_t b, int64_t e) {
      kernels::rmsprop<T>(pp + b, gp + b, sq + b, at(gavg, b), at(buf, b), e - b, lr, alpha, eps, weight_decay,
                          momentum);
    });
  });
}

std::vector<ParamGroup> split_decay(const NamedParams& params, double weight_decay) {
  ParamGroup decay{{}, {{"weight_decay", weight_decay}}};
  ParamGroup no_decay{{}, {{"weight_decay", 0.0}}};
  for (const auto& np : params) (np.second.dim() >= 2 ? decay : no_decay).params.push_back(np);
  return {std::move(decay), std::move(no_decay)};
}

}  // namespace kiln::optim
