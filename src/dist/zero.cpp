// ZeRO stages 1 and 2. See include/kiln/dist/zero.h and docs/distributed.md.
#include "kiln/dist/zero.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <utility>

#include "kiln/core/allocator.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/ops/factory.h"
#include "shard_norm.h"

namespace kiln::dist {

namespace {

// A contiguous 1-D view of all of t's elements.
Tensor flat_view(const Tensor& t) { return t.view({t.numel()}); }

}  // namespace

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(optim::NamedParams params, ProcessGroupPtr group,
                                                 OptimizerFactory make_optimizer, ZeroOptions options)
    : ZeroRedundancyOptimizer(std::vector<optim::ParamGroup>{optim::ParamGroup{std::move(params), {}}},
                              std::move(group), std::move(make_optimizer), options) {}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<optim::ParamGroup> groups, ProcessGroupPtr group,
                                                 OptimizerFactory make_optimizer, ZeroOptions options)
    : group_(std::move(group)), options_(options) {
  KILN_CHECK(group_ != nullptr, ValueError, "ZeroRedundancyOptimizer: expected a process group, got a null pointer");
  KILN_CHECK(group_->is_member(), DistributedError, "ZeroRedundancyOptimizer: this process is not a member of ",
             group_->describe(), "; build it only on the group's ranks (test group->is_member())");
  KILN_CHECK(options_.stage == 1 || options_.stage == 2, ValueError,
             "ZeroRedundancyOptimizer: stage must be 1 (optimizer state sharded) or 2 (gradients too), got ",
             options_.stage, "; stage 3 (parameters sharded) is not implemented");
  KILN_CHECK(make_optimizer != nullptr, ValueError, "ZeroRedundancyOptimizer: expected an optimizer factory");
  for (size_t g = 0; g < groups.size(); ++g) {
    for (auto& [name, p] : groups[g].params) {
      if (p.defined() && !p.requires_grad()) continue;  // frozen: never stepped, as DDP leaves it out
      KILN_CHECK(p.defined(), ValueError, "ZeroRedundancyOptimizer: parameter '", name, "' is an undefined tensor");
      KILN_CHECK(p.dtype() == kFloat32, DTypeError, "ZeroRedundancyOptimizer: parameter '", name, "' is ",
                 dtype_name(p.dtype()), "; the flat shards are float32");
      KILN_CHECK(p.is_contiguous(), ValueError, "ZeroRedundancyOptimizer: parameter '", name,
                 "' is not contiguous (shape ", p.sizes(), ")");
      KILN_CHECK(std::find(names_.begin(), names_.end(), name) == names_.end(), ValueError,
                 "ZeroRedundancyOptimizer: parameter name '", name, "' appears more than once");
      params_.push_back(p);
      names_.push_back(name);
      group_of_.push_back(g);
      offset_.push_back(total_);
      total_ += p.numel();
    }
  }
  KILN_CHECK(total_ > 0, ValueError, "ZeroRedundancyOptimizer: got an empty parameter list (or only empty parameters)");
  const int64_t n = group_->size();
  shard_ = (total_ + n - 1) / n;

  if (options_.broadcast_parameters && n > 1) {
    NoGradGuard no_grad;
    for (Tensor& p : params_) group_->broadcast(p, 0)->wait();
  }

  // This rank's pieces: the parameters that overlap [lo, hi).
  const auto [lo, hi] = shard_range(group_->rank());
  std::vector<optim::ParamGroup> local(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) local[g].options = groups[g].options;
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t b = std::max(lo, offset_[i]);
    const int64_t e = std::min(hi, offset_[i] + params_[i].numel());
    if (b >= e) continue;
    ZeroPiece piece{.param = i, .begin = b - offset_[i], .length = e - b, .flat = b};
    // A detached view shares the parameter's storage: the local optimizer
    // updates this rank's range of the parameter in place.
    Tensor view = flat_view(params_[i].detach()).narrow(0, piece.begin, piece.length);
    pieces_.push_back(piece);
    piece_tensors_.push_back(view);
    local[group_of_[i]].params.emplace_back(names_[i], view);
  }
  if (!pieces_.empty()) local_ = make_optimizer(std::move(local));
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

std::pair<int64_t, int64_t> ZeroRedundancyOptimizer::shard_range(int r) const {
  const int64_t b = std::min<int64_t>(total_, static_cast<int64_t>(r) * shard_);
  return {b, std::min(total_, b + shard_)};
}

void ZeroRedundancyOptimizer::reduce_gradients() {
  if (options_.stage != 2) return;
  bool any = false;
  for (const Tensor& p : params_) any |= p.grad().defined();
  if (!any) return;
  NoGradGuard no_grad;
  const int64_t n = group_->size();
  Tensor in;
  {
    MemoryCategoryGuard cat(MemoryCategory::Workspace);
    in = zeros({n * shard_});
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor g = params_[i].grad();
    if (!g.defined()) continue;
    in.narrow(0, offset_[i], params_[i].numel()).copy_(flat_view(g.contiguous()));
  }
  // Divided first, as DDP: the sum over ranks is then the average.
  if (n > 1) in.div_(static_cast<double>(n));
  Tensor out;
  const bool accumulate = grad_shard_.defined();
  {
    MemoryCategoryGuard cat(accumulate ? MemoryCategory::Workspace : MemoryCategory::Gradient);
    out = empty({shard_});
  }
  if (n > 1) {
    group_->reduce_scatter_tensor(out, in, ReduceOp::Sum)->wait();
  } else {
    out.copy_(in);
  }
  if (accumulate) {
    grad_shard_.add_(out);
  } else {
    grad_shard_ = out;
  }
  in = Tensor();
  for (Tensor& p : params_) p.mutable_grad() = Tensor();
}

void ZeroRedundancyOptimizer::prepare_gradients() {
  NoGradGuard no_grad;
  if (options_.stage == 2) {
    reduce_gradients();
    const int64_t lo = shard_range(group_->rank()).first;
    for (size_t k = 0; k < pieces_.size(); ++k) {
      piece_tensors_[k].mutable_grad() =
          grad_shard_.defined() ? grad_shard_.narrow(0, pieces_[k].flat - lo, pieces_[k].length) : Tensor();
    }
    return;
  }
  // Stage 1: the pieces' gradients are views of DDP's averaged .grad.
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const Tensor g = params_[pieces_[k].param].grad();
    piece_tensors_[k].mutable_grad() =
        g.defined() ? flat_view(g.is_contiguous() ? g : g.contiguous()).narrow(0, pieces_[k].begin, pieces_[k].length)
                    : Tensor();
  }
}

void ZeroRedundancyOptimizer::step() {
  prepare_gradients();
  if (local_) local_->step();
  gather_parameters();
}

void ZeroRedundancyOptimizer::gather_parameters() {
  NoGradGuard no_grad;
  const int64_t n = group_->size();
  if (n == 1) return;  // the pieces are the parameters' own storage
  Tensor all;
  {
    MemoryCategoryGuard cat(MemoryCategory::Workspace);
    all = empty({n * shard_});
  }
  const auto [lo, hi] = shard_range(group_->rank());
  Tensor mine = all.narrow(0, static_cast<int64_t>(group_->rank()) * shard_, shard_);
  for (size_t k = 0; k < pieces_.size(); ++k) {
    mine.narrow(0, pieces_[k].flat - lo, pieces_[k].length).copy_(piece_tensors_[k]);
  }
  group_->allgather_into_tensor(all, mine)->wait();
  for (size_t i = 0; i < params_.size(); ++i) {
    flat_view(params_[i]).copy_(all.narrow(0, offset_[i], params_[i].numel()));
  }
}

void ZeroRedundancyOptimizer::zero_grad(bool set_to_none) {
  NoGradGuard no_grad;
  for (Tensor& p : params_) {
    Tensor& g = p.mutable_grad();
    if (!g.defined()) continue;
    if (set_to_none) {
      g = Tensor();
    } else {
      g.zero_();
    }
  }
  for (Tensor& t : piece_tensors_) t.mutable_grad() = Tensor();
  if (grad_shard_.defined()) {
    if (set_to_none) {
      grad_shard_ = Tensor();
    } else {
      grad_shard_.zero_();
    }
  }
}

double ZeroRedundancyOptimizer::clip_grad_norm_(double max_norm, double norm_type) {
  prepare_gradients();
  std::vector<detail::GradPiece> pieces;
  pieces.reserve(pieces_.size());
  for (size_t k = 0; k < pieces_.size(); ++k) pieces.push_back({pieces_[k].param, piece_tensors_[k].grad()});
  return detail::clip_sharded_grad_norm(*group_, params_.size(), pieces, max_norm, norm_type,
                                        "ZeroRedundancyOptimizer::clip_grad_norm_");
}

optim::OptimizerStateDict ZeroRedundancyOptimizer::state_dict() const {
  return local_ ? local_->state_dict() : optim::OptimizerStateDict{};
}

void ZeroRedundancyOptimizer::load_state_dict(const optim::OptimizerStateDict& sd) {
  if (local_) {
    local_->load_state_dict(sd);
  } else {
    KILN_CHECK(sd.state.empty(), ValueError,
               "ZeroRedundancyOptimizer::load_state_dict: this rank's shard is empty, but the state dict holds "
               "state for ",
               sd.state.size(), " parameter(s)");
  }
}

optim::OptimizerStateDict ZeroRedundancyOptimizer::consolidate_state_dict(int to) {
  NoGradGuard no_grad;
  const int64_t n = group_->size();
  KILN_CHECK(to >= 0 && to < n, ValueError, "ZeroRedundancyOptimizer::consolidate_state_dict: rank ", to, " is not in ",
             group_->describe());
  const int64_t P = static_cast<int64_t>(params_.size());
  // The state keys: rank 0's shard is never empty, and every piece of one
  // optimizer type has the same keys; rank 0 tells the others.
  std::set<std::string> keys;
  if (local_) {
    for (const auto& [name, st] : local_->state())
      for (const auto& [k, t] : st.tensors) keys.insert(k);
  }
  std::string joined;
  for (const auto& k : keys) joined += k + '\n';
  Tensor len = full({1}, static_cast<int64_t>(joined.size()), kInt64);
  if (n > 1) group_->broadcast(len, 0)->wait();
  Tensor chars = zeros({len.data_ptr<int64_t>()[0]}, kInt64);
  for (size_t j = 0; j < joined.size() && group_->rank() == 0; ++j) chars.data_ptr<int64_t>()[j] = joined[j];
  if (n > 1 && chars.numel() > 0) group_->broadcast(chars, 0)->wait();
  std::vector<std::string> names;
  {
    std::string cur;
    for (int64_t j = 0; j < chars.numel(); ++j) {
      const char ch = static_cast<char>(chars.data_ptr<int64_t>()[j]);
      if (ch == '\n') {
        names.push_back(cur);
        cur.clear();
      } else {
        cur += ch;
      }
    }
  }
  // Step counts per parameter: the max over the ranks holding a piece of it.
  Tensor steps = zeros({P}, kInt64);
  if (local_) {
    for (const auto& piece : pieces_) {
      auto it = local_->state().find(names_[piece.param]);
      if (it != local_->state().end()) steps.data_ptr<int64_t>()[piece.param] = it->second.step;
    }
  }
  Tensor all_steps = empty({n * P}, kInt64);
  if (n > 1) {
    group_->allgather_into_tensor(all_steps, steps)->wait();
  } else {
    all_steps.copy_(steps);
  }
  const auto [lo, hi] = shard_range(group_->rank());
  std::map<std::string, Tensor> gathered;
  for (const auto& key : names) {
    Tensor all = zeros({n * shard_});
    Tensor mine = all.narrow(0, static_cast<int64_t>(group_->rank()) * shard_, shard_);
    for (const auto& piece : pieces_) {
      auto it = local_->state().find(names_[piece.param]);
      if (it == local_->state().end()) continue;
      auto t = it->second.tensors.find(key);
      if (t == it->second.tensors.end()) continue;
      mine.narrow(0, piece.flat - lo, piece.length).copy_(t->second);
    }
    if (n > 1) group_->allgather_into_tensor(all, mine)->wait();
    gathered[key] = all;
  }
  optim::OptimizerStateDict sd;
  if (group_->rank() != to) return sd;
  const auto& local_groups = local_ ? local_->param_groups() : std::vector<optim::ParamGroup>{};
  size_t ngroups = 0;
  for (size_t g : group_of_) ngroups = std::max(ngroups, g + 1);
  sd.param_groups.resize(ngroups);
  for (size_t i = 0; i < params_.size(); ++i) sd.param_groups[group_of_[i]].param_names.push_back(names_[i]);
  for (size_t g = 0; g < ngroups && g < local_groups.size(); ++g) sd.param_groups[g].options = local_groups[g].options;
  MemoryCategoryGuard cat(MemoryCategory::OptimizerState);
  for (int64_t i = 0; i < P; ++i) {
    int64_t step = 0;
    for (int64_t r = 0; r < n; ++r) step = std::max(step, all_steps.data_ptr<int64_t>()[r * P + i]);
    if (step == 0) continue;
    optim::ParamState st;
    st.step = step;
    for (const auto& [key, all] : gathered) {
      st.tensors[key] = all.narrow(0, offset_[i], params_[i].numel()).view(params_[i].sizes()).clone();
    }
    sd.state[names_[i]] = std::move(st);
  }
  return sd;
}

}  // namespace kiln::dist
