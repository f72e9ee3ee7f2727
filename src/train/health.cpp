// HealthMonitor (include/kiln/train/health.h).
#include "kiln/train/health.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"

namespace kiln::train {

namespace {

bool is_container(const std::string& type) {
  return type == "Sequential" || type == "ModuleList" || type == "ModuleDict";
}

/// Calls fn(element i as float) for i in [0, numel) of a floating tensor, reading its
/// storage in place: the monitor allocates nothing on a contiguous tensor (so memory
/// peaks and `kiln plan`'s predictions are those of the run without it); a strided
/// one is copied first.
template <typename Fn>
void for_each_float(const Tensor& t, Fn&& fn) {
  NoGradGuard ng;
  Tensor c = t.detach();
  if (!c.is_contiguous()) c = c.contiguous();
  const int64_t n = c.numel();
  visit_dtype<kFloatingTypes>(c.dtype(), "HealthMonitor", [&]<typename T>() {
    const T* p = c.data_ptr<T>();
    for (int64_t i = 0; i < n; ++i) fn(i, static_cast<float>(p[i]));
  });
}

double sum_squares(const Tensor& t) {
  double s = 0;
  for_each_float(t, [&](int64_t, float v) { s += static_cast<double>(v) * v; });
  return s;
}

/// At most this many elements of each parameter are kept to measure its update against:
/// a parameter this small is kept whole (the ratio is exact), a larger one at an even
/// stride (the ratio is estimated from them, within a few percent).
constexpr int64_t kUpdateSamples = 4096;

int64_t sample_stride(int64_t n) { return n <= kUpdateSamples ? 1 : (n + kUpdateSamples - 1) / kUpdateSamples; }

double rms(const Tensor& t) {
  const int64_t n = t.numel();
  return n > 0 ? std::sqrt(sum_squares(t) / static_cast<double>(n)) : 0.0;
}

/// Units of `input` (features: the last dimension; channels for a 4-D input) at or below
/// `threshold` for every sample and position of the batch: (dead, units).
std::pair<int64_t, int64_t> dead_units(const Tensor& input, float threshold) {
  if (input.dim() == 0 || input.numel() == 0) return {0, 0};
  const bool channels = input.dim() == 4;
  const int64_t units = channels ? input.size(1) : input.size(input.dim() - 1);
  std::vector<char> alive(static_cast<size_t>(units), 0);
  const int64_t plane = channels ? input.size(2) * input.size(3) : 1;
  for_each_float(input, [&](int64_t i, float v) {
    if (v > threshold) alive[static_cast<size_t>((i / plane) % units)] = 1;
  });
  int64_t dead = 0;
  for (char a : alive) dead += a ? 0 : 1;
  return {dead, units};
}

}  // namespace

double l2_norm(const Tensor& t) { return t.defined() ? std::sqrt(sum_squares(t)) : 0.0; }

/// What the hooks of one sampled forward write; shared so a hook that outlives the
/// monitor (a gradient hook on a graph kept by the user) writes into live memory.
struct HealthMonitor::Probe {
  std::vector<ActivationHealth> activations;
  std::vector<BlockScale> blocks;
  double input_mean = std::numeric_limits<double>::quiet_NaN();
  double input_std = std::numeric_limits<double>::quiet_NaN();
};

HealthMonitor::HealthMonitor(nn::Module& model, HealthOptions options)
    : model_(model), options_(options), probe_(std::make_shared<Probe>()) {
  KILN_CHECK(options_.every >= 1, ValueError, "HealthMonitor: every must be at least 1 step, got ", options_.every);
  for (auto& entry : model_.named_modules()) {
    const std::string& name = entry.first;
    nn::Module* m = entry.second;
    Group g{name.empty() ? std::string("(root)") : name, m->type_name(), {}, {}, {}};
    for (auto& [pname, p] : m->named_parameters(/*recurse=*/false)) {
      if (!p.requires_grad()) {
        ++frozen_;
        continue;
      }
      ++trainable_;
      g.params.push_back(p);
      g.param_names.push_back(name.empty() ? pname : name + "." + pname);
    }
    if (!g.params.empty()) groups_.push_back(std::move(g));
    const std::string type = m->type_name();
    if (type == "ReLU" || type == "GELU") activation_modules_.emplace_back(name, m);
  }
  // Blocks: the model's children with parameters, containers opened (as FSDP's default units).
  std::vector<std::pair<std::string, nn::Module*>> todo{{"", &model_}};
  while (!todo.empty()) {
    auto [prefix, m] = todo.front();
    todo.erase(todo.begin());
    std::vector<std::pair<std::string, nn::Module*>> opened;
    for (auto& [cname, child] : m->named_children()) {
      const std::string path = prefix.empty() ? cname : prefix + "." + cname;
      if (is_container(child->type_name()))
        opened.emplace_back(path, child.get());
      else if (!child->named_parameters().empty())
        blocks_.emplace_back(path, child.get());
    }
    todo.insert(todo.begin(), opened.begin(), opened.end());
  }
}

HealthMonitor::~HealthMonitor() { remove_hooks(); }

void HealthMonitor::remove_hooks() {
  for (auto& h : hooks_) h.remove();
  hooks_.clear();
}

void HealthMonitor::begin_step(int64_t step) {
  remove_hooks();
  pending_.reset();
  for (auto& g : groups_) g.before.clear();
  if (!sampled(step)) return;
  pending_.emplace();
  pending_->step = step;
  probe_ = std::make_shared<Probe>();
  for (auto& g : groups_) {
    g.weight_sq = 0;
    for (const Tensor& p : g.params) {
      const int64_t stride = sample_stride(p.numel());
      std::vector<float> kept;
      kept.reserve(static_cast<size_t>((p.numel() + stride - 1) / stride));
      for_each_float(p, [&](int64_t i, float v) {
        g.weight_sq += static_cast<double>(v) * v;
        if (i % stride == 0) kept.push_back(v);
      });
      g.before.push_back(std::move(kept));
    }
  }
  if (!options_.activations) return;
  for (auto& entry : activation_modules_) {
    const std::string name = entry.first;  // a copy: the lambda captures it (clang 14 cannot capture bindings)
    const std::string type = entry.second->type_name();
    std::shared_ptr<Probe> probe = probe_;
    hooks_.push_back(
        entry.second->register_forward_hook([probe, name, type](nn::Module&, const Tensor& input, const Tensor&) {
          const auto [dead, units] = dead_units(input, type == "GELU" ? -3.f : 0.f);
          probe->activations.push_back(
              {name, type, units > 0 ? static_cast<double>(dead) / static_cast<double>(units) : 0.0, units});
          return Tensor();
        }));
  }
  // Blocks in the model's order (depth), whatever order forward runs them in; one a forward
  // does not run keeps activation_rms -1 and is left out of the record.
  {
    std::shared_ptr<Probe> probe = probe_;
    hooks_.push_back(model_.register_forward_pre_hook([probe](nn::Module&, const Tensor& input) {
      if (input.defined() && input.is_floating_point() && input.numel() > 0) {
        double sum = 0, sq = 0;
        for_each_float(input, [&](int64_t, float v) {
          sum += v;
          sq += static_cast<double>(v) * v;
        });
        const double n = static_cast<double>(input.numel());
        probe->input_mean = sum / n;
        probe->input_std = std::sqrt(std::max(0.0, sq / n - probe->input_mean * probe->input_mean));
      }
      return Tensor();
    }));
  }
  for (const auto& entry : blocks_) probe_->blocks.push_back({entry.first, -1, -1});
  for (size_t i = 0; i < blocks_.size(); ++i) {
    std::shared_ptr<Probe> probe = probe_;
    hooks_.push_back(
        blocks_[i].second->register_forward_hook([probe, i](nn::Module&, const Tensor&, const Tensor& out) {
          probe->blocks[i].activation_rms = rms(out);
          if (out.requires_grad())
            out.register_hook([probe, i](const Tensor& grad) {
              probe->blocks[i].grad_rms = rms(grad);
              return Tensor();
            });
          return Tensor();
        }));
  }
}

std::optional<HealthRecord> HealthMonitor::end_step() {
  remove_hooks();  // forward and backward are over: an evaluation now runs fused and unobserved
  if (!pending_) return std::nullopt;
  HealthRecord& r = *pending_;
  double total = 0;
  for (auto& g : groups_) {
    ModuleHealth h{g.name, g.type, 0, 0, 0};
    double gsq = 0, dsq = 0;
    for (size_t i = 0; i < g.params.size(); ++i) {
      const Tensor& p = g.params[i];
      const Tensor grad = p.grad();
      if (grad.defined())
        gsq += sum_squares(grad);
      else
        r.no_grad.push_back(g.param_names[i]);
      if (i >= g.before.size()) continue;
      // ||dw||^2 over the kept elements, scaled up to the whole parameter.
      const std::vector<float>& kept = g.before[i];
      const int64_t stride = sample_stride(p.numel());
      double d = 0;
      for_each_float(p, [&](int64_t j, float v) {
        if (j % stride != 0) return;
        const double delta = static_cast<double>(v) - kept[static_cast<size_t>(j / stride)];
        d += delta * delta;
      });
      if (!kept.empty()) dsq += d * static_cast<double>(p.numel()) / static_cast<double>(kept.size());
    }
    g.before.clear();
    total += gsq;
    h.grad_norm = std::sqrt(gsq);
    h.weight_norm = std::sqrt(g.weight_sq);
    h.update_ratio = h.weight_norm > 0 ? std::sqrt(dsq) / h.weight_norm : 0.0;
    r.modules.push_back(std::move(h));
  }
  r.grad_norm = std::sqrt(total);
  r.frozen = frozen_;
  r.trainable = trainable_;
  r.activations = std::move(probe_->activations);
  r.input_mean = probe_->input_mean;
  r.input_std = probe_->input_std;
  for (const BlockScale& b : probe_->blocks)
    if (b.activation_rms >= 0) r.blocks.push_back(b);
  probe_ = std::make_shared<Probe>();
  std::optional<HealthRecord> out = std::move(pending_);
  pending_.reset();
  return out;
}

}  // namespace kiln::train
