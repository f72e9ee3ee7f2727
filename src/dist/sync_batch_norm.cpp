// SyncBatchNorm (include/kiln/dist/sync_batch_norm.h): batch statistics and
// their gradients reduced across a process group, and convert_sync_batchnorm.
//
// The per-rank values exchanged are float64 ([C] vectors and the count), sent
// as their bit patterns in an int64 allgather (the backends reduce float32,
// bfloat16 and int64 only) and combined on every rank in group-rank order, so
// every rank computes bitwise the same global statistics whatever the input
// dtype.
#include "kiln/dist/sync_batch_norm.h"

#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "kiln/autograd/custom_function.h"
#include "kiln/core/autocast.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/dist/dist.h"
#include "kiln/models/resnet.h"
#include "kiln/ops/autocast.h"
#include "kiln/ops/batch_norm.h"
#include "kiln/ops/factory.h"

namespace kiln::dist {

namespace {

std::vector<int64_t> reduce_dims(const Tensor& x) {
  std::vector<int64_t> dims = {0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

std::vector<int64_t> channel_shape(const Tensor& x) {
  std::vector<int64_t> s(static_cast<size_t>(x.dim()), 1);
  s[1] = x.size(1);
  return s;
}

std::vector<double> to_doubles(const Tensor& t) {
  const Tensor c = t.to(kFloat64).contiguous();
  const double* p = c.data_ptr<double>();
  return std::vector<double>(p, p + c.numel());
}

Tensor from_doubles(const std::vector<double>& v, DType dtype) {
  Tensor t = empty({static_cast<int64_t>(v.size())}, TensorOptions().dtype(kFloat64));
  std::memcpy(t.data_ptr<double>(), v.data(), v.size() * sizeof(double));
  return dtype == kFloat64 ? t : t.to(dtype);
}

/// Every member's `mine` (the same length on each), in group-rank order: an
/// allgather of the float64 bit patterns as int64.
std::vector<std::vector<double>> allgather_doubles(ProcessGroup& group, const std::vector<double>& mine) {
  const auto n = static_cast<int64_t>(mine.size());
  Tensor in = empty({n}, TensorOptions().dtype(kInt64));
  std::memcpy(in.data_ptr<int64_t>(), mine.data(), mine.size() * sizeof(double));
  std::vector<Tensor> out;
  for (int r = 0; r < group.size(); ++r) out.push_back(empty({n}, TensorOptions().dtype(kInt64)));
  group.allgather(out, in)->wait();
  std::vector<std::vector<double>> all(out.size(), std::vector<double>(mine.size()));
  for (size_t r = 0; r < out.size(); ++r)
    std::memcpy(all[r].data(), out[r].data_ptr<int64_t>(), mine.size() * sizeof(double));
  return all;
}

/// The global per-channel count, mean and biased variance.
struct GlobalStats {
  double count = 0;
  std::vector<double> mean, var;
};

/// Each rank's (count, mean, M2) per channel, combined in group-rank order
/// with Chan et al.'s pairwise update.
GlobalStats global_stats(ProcessGroup& group, const Tensor& x) {
  const int64_t c = x.size(1);
  const double n = static_cast<double>(c == 0 ? 0 : x.numel() / c);
  std::vector<double> mine(static_cast<size_t>(1 + 2 * c), 0.0);
  mine[0] = n;
  if (n > 0) {
    const auto dims = reduce_dims(x);
    const std::vector<double> mean = to_doubles(x.sum(dims, false, kFloat64) / n);
    // Squares of deviations from the mean rounded to x's dtype; the exact
    // identity sum((x - m')^2) = M2 + n (m - m')^2 removes the rounding's share.
    const Tensor m_x = from_doubles(mean, x.dtype());
    const Tensor d = x - m_x.view(channel_shape(x));
    const std::vector<double> s = to_doubles((d * d).sum(dims, false, kFloat64));
    const std::vector<double> m_rounded = to_doubles(m_x);
    for (int64_t i = 0; i < c; ++i) {
      const double delta = mean[i] - m_rounded[i];
      mine[1 + i] = mean[i];
      mine[1 + c + i] = std::max(0.0, s[i] - n * delta * delta);
    }
  }
  const auto all = allgather_doubles(group, mine);
  GlobalStats g;
  g.mean.assign(static_cast<size_t>(c), 0.0);
  std::vector<double> m2(static_cast<size_t>(c), 0.0);
  for (const auto& r : all) {
    const double nb = r[0];
    if (nb == 0) continue;
    const double na = g.count, nt = na + nb;
    for (int64_t i = 0; i < c; ++i) {
      const double delta = r[1 + i] - g.mean[i];
      g.mean[i] += delta * (nb / nt);
      m2[i] += r[1 + c + i] + delta * delta * (na * nb / nt);
    }
    g.count = nt;
  }
  g.var.resize(static_cast<size_t>(c));
  for (int64_t i = 0; i < c; ++i) g.var[i] = g.count > 0 ? m2[i] / g.count : 0.0;
  return g;
}

/// y = (x - mean) * invstd * weight + bias with the global statistics; its
/// backward exchanges sum(dy) and sum(dy * (x - mean)) across the group.
struct SyncBatchNormFunction : autograd::Function<SyncBatchNormFunction> {
  static Tensor forward(autograd::AutogradContext& ctx, const Tensor& x, const std::optional<Tensor>& weight,
                        const std::optional<Tensor>& bias, const Tensor& mean, const Tensor& invstd,
                        ProcessGroupPtr group, double count) {
    const auto cs = channel_shape(x);
    Tensor y = (x - mean.view(cs)) * invstd.view(cs);
    if (weight && weight->defined()) y = y * weight->view(cs) + bias->view(cs);
    ctx.save_for_backward({x, weight ? *weight : Tensor(), mean, invstd});
    ctx.saved_data["group"] = std::move(group);
    ctx.saved_data["count"] = count;
    return y;
  }

  static TensorList backward(autograd::AutogradContext& ctx, TensorList grads) {
    // create_graph: the formula below treats the global mean and invstd as constants, so its own
    // gradient would be wrong; refuse rather than return a silently wrong second derivative.
    KILN_CHECK(!grad_mode_enabled(), ValueError, "SyncBatchNorm: double backward (create_graph=true) is not supported");
    const auto saved = ctx.get_saved_variables();
    const Tensor& x = saved[0];
    const Tensor& w = saved[1];
    const Tensor& mean = saved[2];
    const Tensor& invstd = saved[3];
    auto& group = ctx.saved_data.get<ProcessGroupPtr>("group");
    const double count = ctx.saved_data.get<double>("count");
    const Tensor& g = grads[0];
    const auto cs = channel_shape(x);
    const auto dims = reduce_dims(x);
    const int64_t c = x.size(1);
    const Tensor xmu = x - mean.view(cs);
    // This rank's sums, in float64; weight and bias gradients are local.
    const Tensor sum_dy = g.sum(dims, false, kFloat64);
    const Tensor sum_dy_xmu = (g * xmu).sum(dims, false, kFloat64);
    const auto& need = ctx.needs_input_grad();
    TensorList out(5);
    if (need.size() > 1 && need[1]) out[1] = (sum_dy_xmu * invstd.to(kFloat64)).to(w.dtype());
    if (need.size() > 2 && need[2]) out[2] = sum_dy.to(w.dtype());
    if (need[0]) {
      std::vector<double> mine = to_doubles(sum_dy);
      const std::vector<double> b = to_doubles(sum_dy_xmu);
      mine.insert(mine.end(), b.begin(), b.end());
      const auto all = allgather_doubles(*group, mine);
      std::vector<double> mean_dy(static_cast<size_t>(c), 0.0), mean_dy_xmu(static_cast<size_t>(c), 0.0);
      for (const auto& r : all)
        for (int64_t i = 0; i < c; ++i) {
          mean_dy[i] += r[i];
          mean_dy_xmu[i] += r[c + i];
        }
      for (int64_t i = 0; i < c; ++i) {
        mean_dy[i] /= count;
        mean_dy_xmu[i] /= count;
      }
      const Tensor k = invstd * invstd * from_doubles(mean_dy_xmu, x.dtype());
      Tensor scale = w.defined() ? invstd * w.to(x.dtype()) : invstd;
      out[0] = (g - from_doubles(mean_dy, x.dtype()).view(cs) - xmu * k.view(cs)) * scale.view(cs);
    }
    return out;
  }
};

/// The training-mode forward on `group` of a SyncBatchNorm / SyncBatchNorm1d.
Tensor sync_forward(nn::BatchNorm& m, ProcessGroup& group, const ProcessGroupPtr& group_ptr, const Tensor& x) {
  const auto& o = m.options;
  const GlobalStats st = global_stats(group, x);
  KILN_CHECK(st.count > 1, ValueError, m.type_name(), " (SyncBatchNorm on ", group.describe(),
             "): expected more than 1 value per channel across the group when training, got ", st.count);
  if (o.track_running_stats) {
    NoGradGuard ng;
    m.num_batches_tracked.add_(1);
    const double momentum = o.momentum ? *o.momentum : 1.0 / m.num_batches_tracked.item<double>();
    ops::batch_norm_update_running_stats(m.running_mean, m.running_var, from_doubles(st.mean, m.running_mean.dtype()),
                                         from_doubles(st.var, m.running_var.dtype()), momentum,
                                         static_cast<int64_t>(st.count));
  }
  std::vector<double> invstd(st.var.size());
  for (size_t i = 0; i < invstd.size(); ++i) invstd[i] = 1.0 / std::sqrt(st.var[i] + o.eps);
  std::optional<Tensor> w, b;
  if (m.weight.defined()) {
    w = m.weight;
    b = m.bias;
  }
  return SyncBatchNormFunction::apply(x, w, b, from_doubles(st.mean, x.dtype()), from_doubles(invstd, x.dtype()),
                                      group_ptr, st.count);
}

/// The group a module syncs over: its own, or the world.
ProcessGroupPtr resolve(const ProcessGroupPtr& g) { return g ? g : world(); }

/// Shared by both classes: plain BatchNorm unless training on a group of more than one rank.
template <typename Base>
Tensor forward_on(Base& m, const ProcessGroupPtr& own, const Tensor& x) {
  if (!m.is_training()) return m.Base::forward(x);
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::batch_norm, [&](const Tensor& xx) { return forward_on(m, own, xx); }, x);
  const ProcessGroupPtr g = resolve(own);
  KILN_CHECK(g->is_member(), ValueError, m.type_name(), " (SyncBatchNorm): this process is not a member of ",
             g->describe());
  if (g->size() == 1) return m.Base::forward(x);
  return sync_forward(m, *g, g, x);
}

std::string group_repr(const ProcessGroupPtr& g) {
  return ", process_group=" + (g ? g->describe() : std::string("the world"));
}

void check_input(const Tensor& x, int64_t c, int64_t min_dim, int64_t max_dim, const std::string& who) {
  KILN_CHECK(x.dim() >= min_dim && x.dim() <= max_dim && x.size(1) == c, ShapeError, who, ": expected a ", min_dim,
             (min_dim == max_dim ? "" : " or " + std::to_string(max_dim)), "-dim input with ", c,
             " channels in dim 1, got shape ", x.shape_string());
}

/// A no-op forward pre-hook: BatchNorm's forward_relu / forward_add_relu (the
/// zoo's fused conv -> BN -> ReLU) then run the module's own (virtual) call.
void route_fused_calls(nn::Module& m) {
  m.register_forward_pre_hook([](nn::Module&, const Tensor&) { return Tensor(); },
                              nn::Module::HookReplay::TensorOpsOnly);
}

}  // namespace

SyncBatchNorm::SyncBatchNorm(nn::BatchNormOptions o, ProcessGroupPtr group)
    : nn::BatchNorm2d(o), group_(std::move(group)) {
  route_fused_calls(*this);
}
Tensor SyncBatchNorm::forward(const Tensor& x) {
  if (is_training()) check_input(x, options.num_features, 4, 4, "SyncBatchNorm");
  return forward_on<nn::BatchNorm2d>(*this, group_, x);
}
std::string SyncBatchNorm::extra_repr() const { return nn::BatchNorm2d::extra_repr() + group_repr(group_); }

SyncBatchNorm1d::SyncBatchNorm1d(nn::BatchNormOptions o, ProcessGroupPtr group)
    : nn::BatchNorm1d(o), group_(std::move(group)) {
  route_fused_calls(*this);
}
Tensor SyncBatchNorm1d::forward(const Tensor& x) {
  if (is_training()) check_input(x, options.num_features, 2, 3, "SyncBatchNorm1d");
  return forward_on<nn::BatchNorm1d>(*this, group_, x);
}
std::string SyncBatchNorm1d::extra_repr() const { return nn::BatchNorm1d::extra_repr() + group_repr(group_); }

namespace {

template <typename Sync>
std::shared_ptr<Sync> make_sync(nn::BatchNorm& old, const ProcessGroupPtr& group, const std::string& where) {
  nn::BatchNormOptions o = old.options;
  if (old.weight.defined())
    o.dtype = old.weight.dtype();
  else if (old.running_mean.defined())
    o.dtype = old.running_mean.dtype();
  auto s = std::make_shared<Sync>(o, group);
  // The same tensors, not copies: an optimizer or a reference built before follows them.
  if (old.weight.defined()) {
    s->register_parameter("weight", old.weight, old.weight.requires_grad());
    s->register_parameter("bias", old.bias, old.bias.requires_grad());
  }
  if (old.running_mean.defined()) {
    s->register_buffer("running_mean", old.running_mean);
    s->register_buffer("running_var", old.running_var);
    s->register_buffer("num_batches_tracked", old.num_batches_tracked);
  }
  s->train(old.is_training());
  const std::string name = where.empty() ? std::string("the module") : "'" + where + "'";
  old.register_forward_pre_hook([name](nn::Module& m, const Tensor&) -> Tensor {
    throw ValueError(detail::concat(
        m.type_name(), " ", name,
        " was replaced by dist::convert_sync_batchnorm but was called: its parent still holds a pointer to "
        "the old module (update that pointer from the parent's registered child)"));
  });
  return s;
}

std::shared_ptr<nn::Module> convert(const std::shared_ptr<nn::Module>& m, const ProcessGroupPtr& group,
                                    const std::string& where) {
  if (dynamic_cast<SyncBatchNorm*>(m.get()) || dynamic_cast<SyncBatchNorm1d*>(m.get())) return m;
  if (auto* bn = dynamic_cast<nn::BatchNorm2d*>(m.get())) return make_sync<SyncBatchNorm>(*bn, group, where);
  if (auto* bn = dynamic_cast<nn::BatchNorm1d*>(m.get())) return make_sync<SyncBatchNorm1d>(*bn, group, where);
  std::shared_ptr<nn::Module> out = m;
  for (auto& [name, child] : m->named_children()) {
    auto c = convert(child, group, where.empty() ? name : where + "." + name);
    if (c != child) m->register_module(name, c);
  }
  // The zoo's models call their norms through typed pointers: point them at the new modules.
  auto bn2d = [&](const std::string& name) {
    for (auto& [n, c] : m->named_children())
      if (n == name) return std::dynamic_pointer_cast<nn::BatchNorm2d>(c);
    return std::shared_ptr<nn::BatchNorm2d>();
  };
  if (auto* r = dynamic_cast<models::ResNet*>(m.get())) r->bn1 = bn2d("bn1");
  if (auto* b = dynamic_cast<models::BasicBlock*>(m.get())) {
    b->bn1 = bn2d("bn1");
    b->bn2 = bn2d("bn2");
  }
  return out;
}

}  // namespace

std::shared_ptr<nn::Module> convert_sync_batchnorm(std::shared_ptr<nn::Module> module, ProcessGroupPtr group) {
  KILN_CHECK(module != nullptr, ValueError, "dist::convert_sync_batchnorm: expected a module, got null");
  return convert(module, group, "");
}

}  // namespace kiln::dist
