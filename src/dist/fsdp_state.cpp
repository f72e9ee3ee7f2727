// FSDP state: full state dicts of the model and of its optimizer, assembled
// from every rank's shards and split back into them. See fsdp.h.
#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <unordered_map>

#include "fsdp_unit.h"
#include "kiln/core/allocator.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/ops/factory.h"

namespace kiln::dist {

namespace {

// Every name a parameter of `model` is reachable under (tied ones under each),
// mapped to the parameter's tensor impl.
std::map<std::string, const TensorImpl*> parameter_keys(nn::Module& model) {
  std::map<std::string, const TensorImpl*> out;
  for (auto& [prefix, m] : model.named_modules()) {
    for (auto& [name, p] : m->named_parameters(/*recurse=*/false)) {
      out[prefix.empty() ? name : prefix + "." + name] = p.impl();
    }
  }
  return out;
}

}  // namespace

nn::NamedTensors FullyShardedDataParallel::full_state_dict() {
  NoGradGuard no_grad;
  std::unordered_map<const TensorImpl*, Tensor> full;
  for (auto& unit : units_) {
    const bool was_sharded = unit->state == Unit::State::Sharded;
    {
      CollectiveLabel label(unit_label(unit->index, "full_state_dict all-gather"));
      wait_gathered(unit->index);
    }
    MemoryCategoryGuard cat(MemoryCategory::Workspace);  // copies handed to the caller
    for (size_t k = 0; k < unit->params.size(); ++k) {
      full[params_[unit->params[k]].impl()] = unit->full_views[k].clone();
    }
    if (was_sharded) reshard(unit->index);
  }
  const auto keys = parameter_keys(*module_);
  nn::NamedTensors out;
  for (auto& [name, t] : module_->state_dict()) {
    auto it = keys.find(name);
    out.emplace_back(name, it != keys.end() ? full.at(it->second) : t);
  }
  return out;
}

void FullyShardedDataParallel::load_full_state_dict(const nn::NamedTensors& dict) {
  const auto keys = parameter_keys(*module_);
  std::unordered_map<const TensorImpl*, size_t> index;
  for (size_t i = 0; i < params_.size(); ++i) index[params_[i].impl()] = i;
  std::map<std::string, Tensor> given(dict.begin(), dict.end());
  std::vector<std::string> problems;
  std::set<std::string> expected;
  std::vector<std::pair<size_t, Tensor>> param_values;
  std::vector<std::pair<Tensor, Tensor>> buffer_values;  // (buffer, value)
  for (auto& [name, t] : module_->state_dict()) {
    expected.insert(name);
    auto g = given.find(name);
    if (g == given.end()) {
      problems.push_back("missing key '" + name + "'");
      continue;
    }
    auto k = keys.find(name);
    DimVector want = t.sizes();
    size_t param = 0;
    if (k != keys.end()) {
      param = index.at(k->second);
      want = units_[unit_of_[param]]->shapes[slot_of_[param]];
    }
    std::ostringstream os;
    if (g->second.sizes() != want.ref()) {
      os << "'" << name << "': expected shape " << want << ", got " << g->second.sizes();
      problems.push_back(os.str());
    } else if (g->second.dtype() != t.dtype()) {
      os << "'" << name << "': expected " << dtype_name(t.dtype()) << ", got " << dtype_name(g->second.dtype());
      problems.push_back(os.str());
    } else if (k != keys.end()) {
      param_values.emplace_back(param, g->second);
    } else {
      buffer_values.emplace_back(t, g->second);
    }
  }
  for (auto& [name, t] : dict) {
    if (!expected.count(name)) problems.push_back("unexpected key '" + name + "'");
  }
  if (!problems.empty()) {
    std::ostringstream os;
    os << "FullyShardedDataParallel::load_full_state_dict: " << problems.size() << " problem(s), nothing loaded: ";
    for (size_t i = 0; i < problems.size(); ++i) os << (i ? "; " : "") << problems[i];
    throw ValueError(os.str());
  }
  NoGradGuard no_grad;
  for (auto& [param, value] : param_values) {
    const Unit& unit = *units_[unit_of_[param]];
    const size_t k = slot_of_[param];
    Tensor piece = unit.pieces[k];
    piece.copy_(value.contiguous().reshape({value.numel()}).narrow(0, unit.piece_begin[k], piece.numel()));
    if (unit.state != Unit::State::Sharded) {
      Tensor view = unit.full_views[k];
      view.copy_(value);
    }
  }
  for (auto& [buffer, value] : buffer_values) {
    Tensor b = buffer;
    b.copy_(value);
  }
}

optim::OptimizerStateDict FullyShardedDataParallel::full_optim_state_dict(const optim::Optimizer& opt) {
  NoGradGuard no_grad;
  const int64_t n = group_->size();
  std::unordered_map<const TensorImpl*, size_t> index;
  for (size_t i = 0; i < params_.size(); ++i) index[params_[i].impl()] = i;
  std::vector<std::string> opt_name(params_.size());
  optim::OptimizerStateDict sd;
  for (const auto& group : opt.param_groups()) {
    optim::OptimizerStateDict::Group g;
    g.options = group.options;
    for (const auto& [name, t] : group.params) {
      auto it = index.find(t.impl());
      KILN_CHECK(it != index.end(), ValueError,
                 "FullyShardedDataParallel::full_optim_state_dict: the optimizer holds '", name,
                 "', which is not a parameter of this FSDP module (build it over fsdp.named_parameters())");
      opt_name[it->second] = name;
      g.param_names.push_back(names_[it->second]);
    }
    sd.param_groups.push_back(std::move(g));
  }
  // Step counts: the largest over the ranks (an empty piece still steps).
  Tensor steps = zeros({static_cast<int64_t>(params_.size())}, kInt64);
  std::set<std::string> keys;
  for (size_t i = 0; i < params_.size(); ++i) {
    auto it = opt_name[i].empty() ? opt.state().end() : opt.state().find(opt_name[i]);
    if (it == opt.state().end()) continue;
    steps.data_ptr<int64_t>()[i] = it->second.step;
    for (const auto& [key, t] : it->second.tensors) keys.insert(key);
  }
  if (n > 1) {
    CollectiveLabel label("FullyShardedDataParallel::full_optim_state_dict");
    group_->allreduce(steps, ReduceOp::Max)->wait();
  }
  MemoryCategoryGuard cat(MemoryCategory::Workspace);
  std::map<std::string, std::vector<Tensor>> gathered;  // key -> per parameter, full shape
  for (const auto& key : keys) {
    auto& per_param = gathered[key];
    per_param.resize(params_.size());
    for (auto& unit : units_) {
      Tensor all = zeros({n * unit->shard});
      Tensor mine = all.narrow(0, group_->rank() * unit->shard, unit->shard);
      for (size_t k = 0; k < unit->params.size(); ++k) {
        const size_t p = unit->params[k];
        auto st = opt_name[p].empty() ? opt.state().end() : opt.state().find(opt_name[p]);
        if (st == opt.state().end()) continue;
        auto t = st->second.tensors.find(key);
        if (t == st->second.tensors.end()) continue;
        KILN_CHECK(t->second.numel() == unit->pieces[k].numel(), ValueError,
                   "FullyShardedDataParallel::full_optim_state_dict: state '", key, "' of ", param_label(p), " has ",
                   t->second.numel(), " elements, expected one per element of its piece (", unit->pieces[k].numel(),
                   ")");
        mine.narrow(0, unit->piece_offset[k], unit->pieces[k].numel()).copy_(t->second.reshape({t->second.numel()}));
      }
      if (n > 1) {
        CollectiveLabel label(unit_label(unit->index, "optimizer state all-gather"));
        group_->allgather_into_tensor(all, mine)->wait();
      }
      for (size_t k = 0; k < unit->params.size(); ++k) {
        const size_t p = unit->params[k];
        const int64_t numel = unit->full_views[k].numel();
        per_param[p] = all.narrow(0, unit->offsets[k], numel).view(unit->shapes[k]).clone();
      }
    }
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t step = steps.data_ptr<int64_t>()[i];
    if (step == 0 || opt_name[i].empty()) continue;
    optim::ParamState st;
    st.step = step;
    for (auto& [key, per_param] : gathered) st.tensors[key] = per_param[i];
    sd.state[names_[i]] = std::move(st);
  }
  return sd;
}

void FullyShardedDataParallel::load_full_optim_state_dict(optim::Optimizer& opt,
                                                          const optim::OptimizerStateDict& full) {
  std::unordered_map<const TensorImpl*, size_t> index;
  for (size_t i = 0; i < params_.size(); ++i) index[params_[i].impl()] = i;
  KILN_CHECK(full.param_groups.size() == opt.param_groups().size(), ValueError,
             "FullyShardedDataParallel::load_full_optim_state_dict: the state dict has ", full.param_groups.size(),
             " parameter groups, the optimizer ", opt.param_groups().size());
  optim::OptimizerStateDict local;
  NoGradGuard no_grad;
  for (size_t g = 0; g < opt.param_groups().size(); ++g) {
    optim::OptimizerStateDict::Group group;
    group.options = full.param_groups[g].options;
    for (const auto& [name, t] : opt.param_groups()[g].params) {
      auto it = index.find(t.impl());
      KILN_CHECK(it != index.end(), ValueError, "FullyShardedDataParallel::load_full_optim_state_dict: the optimizer ",
                 "holds '", name, "', which is not a parameter of this FSDP module");
      group.param_names.push_back(name);
      const size_t p = it->second;
      auto st = full.state.find(names_[p]);
      if (st == full.state.end()) continue;
      const Unit& unit = *units_[unit_of_[p]];
      const size_t k = slot_of_[p];
      optim::ParamState mine;
      mine.step = st->second.step;
      for (const auto& [key, value] : st->second.tensors) {
        KILN_CHECK(value.numel() == unit.full_views[k].numel(), ValueError,
                   "FullyShardedDataParallel::load_full_optim_state_dict: state '", key, "' of ", param_label(p),
                   " has ", value.numel(), " elements, expected ", unit.full_views[k].numel());
        MemoryCategoryGuard cat(MemoryCategory::OptimizerState);
        mine.tensors[key] =
            value.contiguous().reshape({value.numel()}).narrow(0, unit.piece_begin[k], unit.pieces[k].numel()).clone();
      }
      local.state[name] = std::move(mine);
    }
    local.param_groups.push_back(std::move(group));
  }
  opt.load_state_dict(local);
}

}  // namespace kiln::dist
