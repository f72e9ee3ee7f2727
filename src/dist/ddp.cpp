// DistributedDataParallel. See include/kiln/dist/ddp.h.
#include "kiln/dist/ddp.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "ddp_powersgd.h"
#include "ddp_verify.h"
#include "kiln/autograd/engine.h"
#include "kiln/autograd/functions.h"
#include "kiln/autograd/node.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/dist/traffic.h"
#include "kiln/ops/factory.h"

namespace kiln::dist {

// A bucket's flat gradient buffer, the views of it that stand for each
// parameter's gradient, and its in-flight allreduce.
struct DistributedDataParallel::Bucket {
  Tensor flat;
  std::vector<Tensor> views;  // parameter-shaped, in BucketInfo::params order
  int64_t pending = 0;        // gradients not yet ready in this backward
  WorkPtr work;
  std::unique_ptr<detail::PowerSgdBucket> powersgd;  // CommHook::PowerSGD's state, made at its first use
};

namespace {
std::string bucket_label(size_t bucket) { return "DDP gradient bucket " + std::to_string(bucket); }
}  // namespace

// Note [Compressed gradients]
// A compression hook (torch's bf16_compress_hook / fp16_compress_hook) halves
// what a bucket's allreduce moves. torch casts the bucket on the caller's
// stream and copies the result back in a future's callback; here both happen
// inside the process group's allreduce_compressed, on its communication
// thread: the shared-memory path rounds each value to 16 bits as it copies it
// into the segment and widens it as it copies it out, so compressing adds no
// pass over the bucket, and the backward thread, which launches the buckets,
// does no more than for a float32 allreduce. The sum stays in float32 between
// the two roundings (torch's sums in the wire type on NCCL's ring), so .grad
// is a function of the ranks' rounded gradients alone: the same bits on every
// rank, and on 2 ranks through MPI too (docs/ddp.md, "Compressed gradients").
const char* comm_hook_name(CommHook hook) {
  switch (hook) {
    case CommHook::Allreduce: return "allreduce";
    case CommHook::Bf16Compress: return "bf16_compress";
    case CommHook::Fp16Compress: return "fp16_compress";
    case CommHook::PowerSGD: return "powersgd";
    case CommHook::Custom: return "custom";
  }
  return "?";
}

void DistributedDataParallel::register_comm_hook(CommHookFn hook) {
  KILN_CHECK(hook != nullptr, ValueError,
             "DistributedDataParallel::register_comm_hook: expected a hook, got an empty "
             "function");
  KILN_CHECK(!in_backward_, ValueError,
             "DistributedDataParallel::register_comm_hook(custom): called during backward; register the hook between "
             "iterations");
  options_.comm_hook = CommHook::Custom;
  custom_hook_ = std::move(hook);
}

void DistributedDataParallel::register_comm_hook(CommHook hook) {
  KILN_CHECK(hook != CommHook::Custom, ValueError,
             "DistributedDataParallel::register_comm_hook(CommHook::Custom): a custom hook is its function; pass it "
             "(register_comm_hook(CommHookFn))");
  KILN_CHECK(!in_backward_, ValueError, "DistributedDataParallel::register_comm_hook(", comm_hook_name(hook),
             "): called during backward; register the hook between iterations");
  options_.comm_hook = hook;
}

namespace {
void check_powersgd(const PowerSGDOptions& powersgd) {
  KILN_CHECK(powersgd.matrix_approximation_rank >= 1, ValueError,
             "DistributedDataParallel (PowerSGD): matrix_approximation_rank must be >= 1, got ",
             powersgd.matrix_approximation_rank);
  KILN_CHECK(powersgd.start_powerSGD_iter >= 0 && powersgd.min_compression_rate >= 0 &&
                 powersgd.orthogonalization_epsilon >= 0,
             ValueError,
             "DistributedDataParallel (PowerSGD): start_powerSGD_iter, min_compression_rate and "
             "orthogonalization_epsilon must be >= 0, got ",
             powersgd.start_powerSGD_iter, ", ", powersgd.min_compression_rate, " and ",
             powersgd.orthogonalization_epsilon);
}
}  // namespace

void DistributedDataParallel::register_comm_hook(const PowerSGDOptions& powersgd) {
  check_powersgd(powersgd);
  register_comm_hook(CommHook::PowerSGD);
  options_.powersgd = powersgd;
  // A new state, as torch's new PowerSGDState: its count of plain steps, Qs
  // and errors start over (an old layout may have another rank).
  powersgd_rng_.manual_seed(powersgd.random_seed);
  powersgd_iter_ = 0;
  for (auto& b : state_) b->powersgd.reset();
  powersgd_kept_.clear();
}

// Note [PowerSGD state by parameter]
// A bucket's PowerSGD buffers hold its gradients' Qs and errors side by side;
// outside a bucket the state is kept by parameter, since the same gradient
// lands in another bucket after the rebuild, and in another again when a
// resumed run's fresh wrapper lays out its first buckets. Each gradient's
// values are computed alone (its P and Q are its own; a sum over ranks is
// the same for a value wherever it sits in the buffer), so a state carried
// over into another layout gives the bits the old layout would have.
// Before, a rebuild started PowerSGD afresh for every bucket.
std::map<size_t, std::pair<Tensor, Tensor>> DistributedDataParallel::bucket_powersgd_state() const {
  std::map<size_t, std::pair<Tensor, Tensor>> out;
  for (size_t b = 0; b < state_.size(); ++b) {
    const detail::PowerSgdBucket* pb = state_[b]->powersgd.get();
    if (pb == nullptr) continue;
    for (const auto& mt : pb->matrices) {
      detail::PowerSgdMatrixState st = detail::powersgd_matrix_state(*pb, mt);
      if (st.q.defined() || st.error.defined())
        out[buckets_[b].params[mt.slot]] = {std::move(st.q), std::move(st.error)};
    }
  }
  return out;
}

PowerSGDState DistributedDataParallel::powersgd_state() const {
  KILN_CHECK(options_.comm_hook == CommHook::PowerSGD, ValueError,
             "DistributedDataParallel::powersgd_state: the communication hook is '", comm_hook_name(options_.comm_hook),
             "', not 'powersgd'");
  PowerSGDState s;
  s.iter = powersgd_iter_;
  s.rng = powersgd_rng_.get_state();
  // A parameter's state is kept outside the buckets until its bucket next compresses, and then only inside.
  std::map<size_t, std::pair<Tensor, Tensor>> all = bucket_powersgd_state();
  for (const auto& [i, qe] : powersgd_kept_)
    all.try_emplace(i, qe.first.defined() ? qe.first.clone() : Tensor(),
                    qe.second.defined() ? qe.second.clone() : Tensor());
  for (auto& [i, qe] : all) {
    if (qe.first.defined()) s.q[names_[i]] = std::move(qe.first);
    if (qe.second.defined()) s.error[names_[i]] = std::move(qe.second);
  }
  return s;
}

void DistributedDataParallel::load_powersgd_state(const PowerSGDState& state) {
  KILN_CHECK(options_.comm_hook == CommHook::PowerSGD, ValueError,
             "DistributedDataParallel::load_powersgd_state: the communication hook is '",
             comm_hook_name(options_.comm_hook), "', not 'powersgd'; register_comm_hook(PowerSGDOptions) first");
  KILN_CHECK(!in_backward_, ValueError, "DistributedDataParallel::load_powersgd_state: not during a backward");
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < names_.size(); ++i) index[names_[i]] = i;
  std::map<size_t, std::pair<Tensor, Tensor>> kept;
  auto take = [&](const std::map<std::string, Tensor>& part, bool is_q) {
    for (const auto& [name, t] : part) {
      const auto it = index.find(name);
      KILN_CHECK(it != index.end(), ValueError, "DistributedDataParallel::load_powersgd_state: '", name,
                 "' is not a parameter of the wrapped module");
      const detail::PowerSgdShape sh = detail::powersgd_shape(params_[it->second].sizes(), options_.powersgd);
      KILN_CHECK(sh.compress, ValueError, "DistributedDataParallel::load_powersgd_state: '", name, "' (shape ",
                 params_[it->second].sizes(), ") is averaged as it is under matrix_approximation_rank ",
                 options_.powersgd.matrix_approximation_rank, " and min_compression_rate ",
                 options_.powersgd.min_compression_rate, ", so it has no PowerSGD state");
      const DimVector want = is_q ? DimVector{sh.m, sh.r} : DimVector{sh.n, sh.m};
      KILN_CHECK(t.defined() && t.dtype() == kFloat32 && t.sizes() == IntArrayRef(want), ValueError,
                 "DistributedDataParallel::load_powersgd_state: ", is_q ? "Q" : "error", " of '", name,
                 "' must be float32 ", want, ", got ", t.defined() ? dtype_name(t.dtype()) : "undefined", " ",
                 t.defined() ? t.sizes() : IntArrayRef{});
      (is_q ? kept[it->second].first : kept[it->second].second) = t.contiguous().clone();
    }
  };
  take(state.q, true);
  take(state.error, false);
  powersgd_iter_ = state.iter;
  powersgd_rng_.set_state(state.rng);
  for (auto& b : state_) b->powersgd.reset();
  powersgd_kept_ = std::move(kept);
}

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<nn::Module> module, ProcessGroupPtr group,
                                                 DDPOptions options)
    : nn::Module("DistributedDataParallel"),
      module_(std::move(module)),
      group_(std::move(group)),
      options_(options),
      epoch_(std::chrono::steady_clock::now()) {
  KILN_CHECK(module_ != nullptr, ValueError, "DistributedDataParallel: expected a module, got a null pointer");
  KILN_CHECK(group_ != nullptr, ValueError, "DistributedDataParallel: expected a process group, got a null pointer");
  KILN_CHECK(group_->is_member(), DistributedError, "DistributedDataParallel: this process is not a member of ",
             group_->describe(), "; wrap the model only on the group's ranks (test group->is_member())");
  KILN_CHECK(options_.bucket_cap_mb > 0, ValueError, "DistributedDataParallel: bucket_cap_mb must be > 0, got ",
             options_.bucket_cap_mb);
  if (options_.comm_hook == CommHook::PowerSGD) check_powersgd(options_.powersgd);
  KILN_CHECK(options_.comm_hook != CommHook::Custom, ValueError,
             "DistributedDataParallel: DDPOptions::comm_hook = CommHook::Custom needs its function; construct with "
             "another hook and call register_comm_hook(CommHookFn)");
  powersgd_rng_.manual_seed(options_.powersgd.random_seed);
  // As torch: state_dict() keys of the wrapper start with "module.".
  register_module("module", module_);
  for (auto& [name, p] : module_->named_parameters()) {
    if (!p.requires_grad()) continue;
    KILN_CHECK(p.dtype() == kFloat32 || p.dtype() == kBFloat16, DTypeError, "DistributedDataParallel: parameter '",
               name, "' is ", dtype_name(p.dtype()), "; gradients can be averaged for float32 and bfloat16 only");
    KILN_CHECK(p.is_contiguous(), ValueError, "DistributedDataParallel: parameter '", name,
               "' is not contiguous (shape ", p.sizes(), ")");
    params_.push_back(p);
    names_.push_back(name);
  }
  KILN_CHECK(!params_.empty(), ValueError,
             "DistributedDataParallel: the module has no parameter that requires a "
             "gradient, so there is nothing to average; DDP is not needed for it");
  {
    std::vector<std::pair<std::string, Tensor>> params, buffers;
    for (size_t i = 0; i < params_.size(); ++i) params.emplace_back(names_[i], params_[i]);
    for (auto& nb : module_->named_buffers()) buffers.emplace_back(nb.first, nb.second);
    detail::verify_same_model(*group_, params, buffers);
  }
  KILN_CHECK(options_.first_bucket_cap_mb > 0, ValueError,
             "DistributedDataParallel: first_bucket_cap_mb must be > 0, got ", options_.first_bucket_cap_mb);
  KILN_CHECK(options_.last_bucket_cap_mb >= 0, ValueError,
             "DistributedDataParallel: last_bucket_cap_mb must be >= 0 (0: no cap of its own), got ",
             options_.last_bucket_cap_mb);
  broadcast_state(/*params=*/true);
  {
    std::vector<size_t> reverse(params_.size());
    for (size_t k = 0; k < params_.size(); ++k) reverse[k] = params_.size() - 1 - k;
    assign_buckets(reverse);
  }
  ready_.assign(params_.size(), 0);
  had_grad_.assign(params_.size(), 1);
  for (size_t i = 0; i < params_.size(); ++i) {
    hooks_.push_back(params_[i].register_post_accumulate_grad_hook([this, i](Tensor&) { on_gradient_ready(i); }));
  }
}

DistributedDataParallel::~DistributedDataParallel() {
  for (auto& h : hooks_) h.remove();
}

double DistributedDataParallel::now() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch_).count();
}

void DistributedDataParallel::broadcast_state(bool params) {
  if (group_->size() == 1) return;
  NoGradGuard no_grad;
  if (params) {
    for (Tensor& p : params_) group_->broadcast(p, 0)->wait();
  }
  for (auto& [name, b] : module_->named_buffers()) {
    KILN_CHECK(b.is_contiguous(), ValueError, "DistributedDataParallel: buffer '", name,
               "' is not contiguous; it cannot be broadcast from rank 0");
    group_->broadcast(b, 0)->wait();
  }
}

// Backward produces gradients roughly in reverse registration order, so
// buckets filled in that order (until rebuild_buckets knows the real order)
// become ready one after another while backward still runs. Parameters of
// different dtypes never share a bucket. The first bucket of each dtype is
// kept small so that its allreduce starts early.
void DistributedDataParallel::assign_buckets(const std::vector<size_t>& order) {
  const auto cap = static_cast<int64_t>(options_.bucket_cap_mb * 1024.0 * 1024.0);
  const auto first_cap =
      static_cast<int64_t>(std::min(options_.first_bucket_cap_mb, options_.bucket_cap_mb) * 1024.0 * 1024.0);
  buckets_.clear();
  state_.clear();
  std::map<DType, size_t> open;  // dtype -> bucket still taking parameters
  std::map<DType, int> made;     // dtype -> buckets made so far
  for (size_t k : order) {
    const Tensor& p = params_[k];
    auto it = open.find(p.dtype());
    const int64_t limit = made[p.dtype()] == 1 ? first_cap : cap;  // the dtype's first bucket is open
    if (it == open.end() || buckets_[it->second].bytes + p.nbytes() > limit) {
      buckets_.push_back(BucketInfo{.params = {}, .bytes = 0, .dtype = p.dtype()});
      open[p.dtype()] = buckets_.size() - 1;
      ++made[p.dtype()];
      it = open.find(p.dtype());
    }
    buckets_[it->second].params.push_back(k);
    buckets_[it->second].bytes += p.nbytes();
  }
  if (options_.last_bucket_cap_mb > 0) split_last_buckets();
  bucket_of_.assign(params_.size(), 0);
  slot_of_.assign(params_.size(), 0);
  for (size_t b = 0; b < buckets_.size(); ++b) {
    auto st = std::make_unique<Bucket>();
    const BucketInfo& info = buckets_[b];
    st->flat = zeros({info.bytes / element_size(info.dtype)},
                     TensorOptions().dtype(info.dtype).category(MemoryCategory::Gradient));
    int64_t offset = 0;
    for (size_t s = 0; s < info.params.size(); ++s) {
      const Tensor& p = params_[info.params[s]];
      st->views.push_back(st->flat.narrow(0, offset, p.numel()).view(p.sizes()));
      offset += p.numel();
      bucket_of_[info.params[s]] = b;
      slot_of_[info.params[s]] = s;
    }
    state_.push_back(std::move(st));
  }
}

// With last_bucket_cap_mb, each dtype's last bucket keeps only its trailing
// parameters (in fill order, so the gradients that become ready last) up to
// that cap, at least one; the others stay in the bucket before it.
void DistributedDataParallel::split_last_buckets() {
  const auto last_cap = static_cast<int64_t>(options_.last_bucket_cap_mb * 1024.0 * 1024.0);
  std::map<DType, size_t> last;
  for (size_t b = 0; b < buckets_.size(); ++b) last[buckets_[b].dtype] = b;
  std::vector<size_t> split;
  for (auto& [dt, b] : last) {
    if (buckets_[b].bytes > last_cap && buckets_[b].params.size() > 1) split.push_back(b);
  }
  std::sort(split.rbegin(), split.rend());  // later indices first: inserting keeps earlier ones valid
  for (size_t b : split) {
    BucketInfo tail{.params = {}, .bytes = 0, .dtype = buckets_[b].dtype};
    std::vector<size_t>& ps = buckets_[b].params;
    while (ps.size() > 1) {
      const int64_t nb = params_[ps.back()].nbytes();
      if (!tail.params.empty() && tail.bytes + nb > last_cap) break;
      tail.params.insert(tail.params.begin(), ps.back());
      tail.bytes += nb;
      ps.pop_back();
    }
    buckets_[b].bytes -= tail.bytes;
    buckets_.insert(buckets_.begin() + static_cast<std::ptrdiff_t>(b) + 1, std::move(tail));
  }
}

// As torch: the first synced backward tells the order gradients really
// arrive in (gpt's tied token embedding, first in registration order, is
// ready last); buckets filled in that order launch as early as possible.
// Ranks may see different orders (thread timing, rank-dependent control
// flow), so rank 0's is broadcast and every rank uses it: all ranks must lay
// out the same buckets to issue the same allreduces. Gradients already
// accumulated (no_sync steps) move into the new buckets.
void DistributedDataParallel::maybe_rebuild_buckets() {
  if (rebuild_decided_ || !synced_backward_seen_ || !options_.rebuild_buckets || options_.find_unused_parameters) {
    return;
  }
  rebuild_decided_ = true;
  const auto n = static_cast<int64_t>(params_.size());
  // [complete on rank 0 (0/1), order...]: a rank 0 whose first backward did not
  // finish (an error) has no order to give, and then nobody rebuilds.
  Tensor msg = zeros({n + 1}, kInt64);
  int64_t* m = msg.data_ptr<int64_t>();
  const bool complete = static_cast<int64_t>(first_ready_order_.size()) == n;
  if (complete) {
    m[0] = 1;
    for (int64_t i = 0; i < n; ++i) m[i + 1] = static_cast<int64_t>(first_ready_order_[static_cast<size_t>(i)]);
  }
  if (group_->size() > 1) {
    CollectiveLabel label("DDP bucket rebuild order");
    group_->broadcast(msg, 0)->wait();
  }
  first_ready_order_.clear();
  if (m[0] != 1) return;
  std::vector<size_t> order(static_cast<size_t>(n));
  std::vector<char> seen(static_cast<size_t>(n), 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = m[i + 1];
    KILN_CHECK(k >= 0 && k < n && !seen[static_cast<size_t>(k)], DistributedError,
               "DistributedDataParallel: rank 0's gradient ready order is not a permutation of the ", n,
               " parameters (entry ", i, " is ", k, "); the ranks' models differ");
    seen[static_cast<size_t>(k)] = 1;
    order[static_cast<size_t>(i)] = static_cast<size_t>(k);
  }
  NoGradGuard no_grad;
  for (auto& [i, qe] : bucket_powersgd_state())
    powersgd_kept_[i] = std::move(qe);  // Note [PowerSGD state by parameter]
  assign_buckets(order);
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor& grad = params_[i].mutable_grad();
    if (!grad.defined()) continue;
    Tensor& view = state_[bucket_of_[i]]->views[slot_of_[i]];
    view.copy_(grad);
    if (options_.gradient_as_bucket_view) grad = view;
  }
  rebuilt_ = true;
}

Tensor DistributedDataParallel::forward(const Tensor& input) {
  if (in_backward_) {
    // The last backward ended in an error before our callback ran: drain what
    // it started so the buckets can be reused.
    in_backward_ = false;
    for (auto& b : state_) {
      if (b->work) std::exchange(b->work, nullptr)->wait();
    }
  }
  if (sync_) maybe_rebuild_buckets();
  if (sync_ && options_.broadcast_buffers) broadcast_state(/*params=*/false);
  Tensor out = (*module_)(input);
  unused_in_forward_.clear();
  if (sync_ && options_.find_unused_parameters && out.requires_grad()) find_unused(out);
  epoch_ = std::chrono::steady_clock::now();
  return out;
}

// As torch: parameters the output's graph does not reach will get no
// gradient, so they are marked ready as soon as backward starts and their
// buckets need not wait for the end of backward.
void DistributedDataParallel::find_unused(const Tensor& out) {
  std::unordered_map<const void*, size_t> index;
  for (size_t i = 0; i < params_.size(); ++i) index[params_[i].data_ptr()] = i;
  std::vector<char> reached(params_.size(), 0);
  std::unordered_set<const autograd::Node*> seen;
  std::vector<autograd::Node*> stack;
  if (out.grad_fn()) stack.push_back(out.grad_fn());
  while (!stack.empty()) {
    autograd::Node* n = stack.back();
    stack.pop_back();
    if (!seen.insert(n).second) continue;
    if (auto* acc = dynamic_cast<autograd::AccumulateGrad*>(n)) {
      if (auto it = index.find(acc->leaf().data_ptr()); it != index.end()) reached[it->second] = 1;
    }
    for (const auto& e : n->next_edges()) {
      if (e.is_valid()) stack.push_back(e.function.get());
    }
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!reached[i]) unused_in_forward_.push_back(i);
  }
}

// find_unused_parameters: an unused parameter contributes what it has (a
// gradient kept from no_sync steps) or zero.
void DistributedDataParallel::mark_unused_ready(size_t i) {
  NoGradGuard no_grad;
  Bucket& b = *state_[bucket_of_[i]];
  Tensor& view = b.views[slot_of_[i]];
  const Tensor& grad = params_[i].grad();
  had_grad_[i] = grad.defined() ? 1 : 0;
  if (!grad.defined()) {
    view.zero_();
  } else if (grad.data_ptr() != view.data_ptr()) {
    view.copy_(grad);
  }
  ready_[i] = 1;
  ++num_ready_;
  stats_.ready_order.push_back(i);
  --b.pending;
}

void DistributedDataParallel::on_gradient_ready(size_t index) {
  if (!sync_) return;  // no_sync: the gradient just accumulates in .grad
  if (!in_backward_) {
    // The first gradient of a backward pass: start its bookkeeping and ask the
    // engine to call back once every gradient has been accumulated.
    in_backward_ = true;
    std::fill(ready_.begin(), ready_.end(), 0);
    num_ready_ = 0;
    next_launch_ = 0;
    for (size_t b = 0; b < state_.size(); ++b) {
      state_[b]->pending = static_cast<int64_t>(buckets_[b].params.size());
      state_[b]->work.reset();
    }
    stats_ = DDPStats{};
    stats_.ready_order.reserve(params_.size());
    if (!hook_verified_) {
      // Once, at the first synced backward, which every rank runs: a rank
      // whose hook differs would otherwise exchange its buckets in another form.
      hook_verified_ = true;
      detail::verify_same_hook(*group_, options_.comm_hook, options_.powersgd);
    }
    powersgd_now_ = options_.comm_hook == CommHook::PowerSGD && group_->size() > 1 &&
                    powersgd_iter_ >= options_.powersgd.start_powerSGD_iter;
    stats_.powersgd = powersgd_now_;
    std::fill(had_grad_.begin(), had_grad_.end(), 1);
    synced_backward_seen_ = true;
    autograd::queue_callback([this] { finalize_backward(); });
    for (size_t i : unused_in_forward_) {
      if (i != index) mark_unused_ready(i);
    }
    unused_in_forward_.clear();
  }
  KILN_CHECK(!ready_[index], ValueError, "DistributedDataParallel: parameter '", names_[index],
             "' received its gradient twice in one backward pass; a parameter shared by several modules must be "
             "registered once, and each backward needs its own forward");
  Tensor& grad = params_[index].mutable_grad();
  Tensor& view = state_[bucket_of_[index]]->views[slot_of_[index]];
  {
    NoGradGuard no_grad;
    if (grad.data_ptr() != view.data_ptr()) {
      view.copy_(grad);
      if (options_.gradient_as_bucket_view) grad = view;
    }
  }
  ready_[index] = 1;
  ++num_ready_;
  stats_.ready_order.push_back(index);
  stats_.last_gradient_ready = now();
  --state_[bucket_of_[index]]->pending;
  launch_ready_buckets();
}

// Buckets are launched strictly in index order, so every rank issues the same
// sequence of allreduces even when its gradients arrive in another order.
void DistributedDataParallel::launch_ready_buckets() {
  NoGradGuard no_grad;
  while (next_launch_ < state_.size() && state_[next_launch_]->pending == 0) {
    Bucket& b = *state_[next_launch_];
    // ReduceOp::Avg: the division by the world size is the process group's,
    // done on its communication thread as the reduced bucket comes out, not
    // a pass of this (the backward) thread. A world of one has nothing to exchange.
    if (group_->size() > 1) {
      // Named in mismatch reports and in profiles (the allreduce's detail): which bucket, issued in backward.
      CollectiveLabel label(bucket_label(next_launch_));
      // Note [Compressed gradients]: a float32 bucket under a compression
      // hook is rounded to 16 bits as it enters the shared segment and widened
      // as it leaves, by the communication thread, so compressing costs this
      // thread nothing and the wire half the bytes.
      const bool compress =
          (options_.comm_hook == CommHook::Bf16Compress || options_.comm_hook == CommHook::Fp16Compress) &&
          b.flat.dtype() == kFloat32;
      if (options_.comm_hook == CommHook::Custom) {
        GradBucket gb;
        gb.index = next_launch_;
        gb.is_last = next_launch_ + 1 == state_.size();
        gb.buffer = b.flat;
        gb.gradients = b.views;
        gb.parameters = buckets_[next_launch_].params;
        const int64_t before = traffic().bytes;
        b.work = custom_hook_(*group_, gb);
        stats_.wire_bytes += traffic().bytes - before;  // what the hook handed to collectives as it ran
      } else if (powersgd_now_ && b.flat.dtype() == kFloat32) {
        if (!b.powersgd) {
          b.powersgd =
              std::make_unique<detail::PowerSgdBucket>(detail::plan_powersgd(b.flat, b.views, options_.powersgd));
          for (auto& mt : b.powersgd->matrices) {  // Note [PowerSGD state by parameter]
            const auto kept = powersgd_kept_.find(buckets_[next_launch_].params[mt.slot]);
            if (kept == powersgd_kept_.end()) continue;
            detail::powersgd_restore(*b.powersgd, mt, {kept->second.first, kept->second.second}, b.flat.numel());
            powersgd_kept_.erase(kept);
          }
        }
        detail::powersgd_launch(*b.powersgd, b.flat, *group_, options_.powersgd, powersgd_rng_, stats_.wire_bytes);
      } else if (compress) {
        const DType wire = options_.comm_hook == CommHook::Bf16Compress ? kBFloat16 : kFloat16;
        b.work = group_->allreduce_compressed(b.flat, wire, ReduceOp::Avg);
        stats_.wire_bytes += b.flat.numel() * 2;
      } else {
        b.work = group_->allreduce(b.flat, ReduceOp::Avg);
        stats_.wire_bytes += b.flat.nbytes();
      }
    }
    if (stats_.allreduces == 0) {
      stats_.first_allreduce_start = now();
      stats_.pending_at_first_allreduce = static_cast<int64_t>(params_.size()) - num_ready_;
    }
    ++stats_.allreduces;
    stats_.launch_order.push_back(next_launch_);
    ++next_launch_;
  }
}

void DistributedDataParallel::finalize_backward() {
  in_backward_ = false;
  stats_.backward_end = now();
  std::vector<size_t> unused;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!ready_[i]) unused.push_back(i);
  }
  // PowerSGD buckets exchange Q after backward (Note [PowerSGD in three
  // exchanges]); on the error path below they are only drained.
  auto wait_all = [&](bool complete = true) {
    const double t0 = now();
    for (auto& b : state_) {
      if (b->powersgd && powersgd_now_ && complete)
        detail::powersgd_exchange_q(*b->powersgd, b->flat, *group_, options_.powersgd, stats_.wire_bytes);
    }
    for (auto& b : state_) {
      if (b->work) b->work->wait();
      if (b->powersgd && powersgd_now_) {
        if (complete) {
          detail::powersgd_finish(*b->powersgd, b->flat, options_.powersgd);
        } else {
          detail::powersgd_drain(*b->powersgd);
        }
      }
    }
    stats_.exposed_comm_seconds = now() - t0;
  };
  if (!unused.empty() && !options_.find_unused_parameters) {
    wait_all(false);  // leave no collective of ours in flight
    std::ostringstream os;
    os << "DistributedDataParallel: " << unused.size() << " of " << params_.size()
       << " parameters got no gradient in this backward pass, so their gradients cannot be averaged across "
          "ranks: ";
    for (size_t k = 0; k < unused.size(); ++k) os << (k ? ", " : "") << "'" << names_[unused[k]] << "'";
    os << ". If parts of the model are legitimately unused in some iterations, construct DDP with "
          "find_unused_parameters = true (their gradients are then taken as zero); otherwise make sure every "
          "parameter takes part in computing the loss";
    throw ValueError(os.str());
  }
  if (!unused.empty()) {
    for (size_t i : unused) mark_unused_ready(i);
    launch_ready_buckets();
  }
  Tensor used;
  WorkPtr used_work;
  if (options_.find_unused_parameters) {
    // Every rank issues this collective, whether or not it found unused
    // parameters, so that the sequences of collectives stay alike.
    used = empty({static_cast<int64_t>(params_.size())}, kInt64);
    int64_t* u = used.data_ptr<int64_t>();
    for (size_t i = 0; i < params_.size(); ++i) u[i] = had_grad_[i];
    if (group_->size() > 1) used_work = group_->allreduce(used, ReduceOp::Sum);
  }
  wait_all();
  if (used_work) used_work->wait();
  NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor& grad = params_[i].mutable_grad();
    const Tensor& view = state_[bucket_of_[i]]->views[slot_of_[i]];
    if (used.defined() && used.data_ptr<int64_t>()[i] == 0) {
      continue;  // no rank has a gradient for it: leave .grad undefined, as torch
    }
    if (options_.gradient_as_bucket_view) {
      if (!grad.defined() || grad.data_ptr() != view.data_ptr()) grad = view;
    } else if (grad.defined()) {
      grad.copy_(view);
    } else {
      grad = view.clone();
    }
  }
  if (options_.comm_hook == CommHook::PowerSGD) ++powersgd_iter_;  // torch counts the plain steps too
  // rebuild_buckets: this backward's order, if it is the first one that completed.
  if (options_.rebuild_buckets && !options_.find_unused_parameters && !rebuild_decided_ && first_ready_order_.empty()) {
    first_ready_order_ = stats_.ready_order;
  }
}

DistributedDataParallel::NoSync::NoSync(DistributedDataParallel& ddp) : ddp_(ddp), prev_(ddp.sync_) {
  ddp_.sync_ = false;
}

DistributedDataParallel::NoSync::~NoSync() { ddp_.sync_ = prev_; }

}  // namespace kiln::dist
