// FSDP's sharded checkpoints: every rank writes its own pieces and reads back
// the ranges of whatever pieces it has at load, at any world size. See fsdp.h.
#include <cstdio>
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

constexpr const char* kFormatKey = "kiln.fsdp";

std::string number(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string group_key(size_t g, const std::string& hp) { return "optim.group." + std::to_string(g) + "." + hp; }

}  // namespace

void FullyShardedDataParallel::save_sharded_checkpoint(const std::filesystem::path& dir, const optim::Optimizer* opt,
                                                       ShardedMetadata metadata) {
  NoGradGuard no_grad;
  std::unordered_map<const TensorImpl*, size_t> index;
  for (size_t i = 0; i < params_.size(); ++i) index[params_[i].impl()] = i;
  std::vector<ShardSlice> slices;
  for (const auto& unit : units_) {
    for (size_t k = 0; k < unit->params.size(); ++k) {
      const size_t p = unit->params[k];
      slices.push_back({"model." + names_[p], unit->shapes[k].ref().vec(), unit->piece_begin[k], unit->pieces[k]});
    }
  }
  const bool lead = group_->rank() == 0;
  for (auto& [name, b] : module_->named_buffers()) {
    if (lead) slices.push_back({"model." + name, b.sizes().vec(), 0, b});
  }
  metadata[kFormatKey] = "1";
  if (opt) {
    for (size_t g = 0; g < opt->param_groups().size(); ++g) {
      for (const auto& [hp, v] : opt->param_groups()[g].options) metadata[group_key(g, hp)] = number(v);
    }
    for (const auto& group : opt->param_groups()) {
      for (const auto& [name, t] : group.params) {
        auto it = index.find(t.impl());
        KILN_CHECK(it != index.end(), ValueError, "FullyShardedDataParallel::save_sharded_checkpoint: the optimizer ",
                   "holds '", name, "', which is not a parameter of this FSDP module");
        const size_t p = it->second;
        const Unit& unit = *units_[unit_of_[p]];
        const size_t k = slot_of_[p];
        auto st = opt->state().find(name);
        if (st == opt->state().end()) continue;
        for (const auto& [key, value] : st->second.tensors) {
          KILN_CHECK(value.numel() == unit.pieces[k].numel(), ValueError,
                     "FullyShardedDataParallel::save_sharded_checkpoint: state '", key, "' of ", param_label(p),
                     " has ", value.numel(), " elements, expected one per element of its piece (",
                     unit.pieces[k].numel(), ")");
          slices.push_back({"optim." + names_[p] + "." + key, unit.shapes[k].ref().vec(), unit.piece_begin[k], value});
        }
        if (lead) slices.push_back({"optim." + names_[p] + ".step", {1}, 0, full({1}, st->second.step, kInt64)});
      }
    }
  }
  CollectiveLabel label("FullyShardedDataParallel::save_sharded_checkpoint");
  dist::save_sharded_checkpoint(dir, slices, metadata, *group_);
}

ShardedMetadata FullyShardedDataParallel::load_sharded_checkpoint(const std::filesystem::path& dir,
                                                                  optim::Optimizer* opt) {
  const ShardedCheckpoint ck(dir);
  const std::string who = "FullyShardedDataParallel::load_sharded_checkpoint(" + dir.string() + ")";
  KILN_CHECK(ck.metadata().count(kFormatKey), FormatError, who, ": not an FSDP checkpoint (its index has no '",
             kFormatKey, "' entry)");
  // Check every tensor before changing anything.
  std::vector<std::string> problems;
  auto expect = [&](const std::string& name, IntArrayRef shape, DType dtype) {
    if (!ck.contains(name)) {
      problems.push_back("missing '" + name + "'");
    } else if (ck.shape(name) != shape.vec() || ck.dtype(name) != dtype) {
      std::ostringstream os;
      os << "'" << name << "': expected " << dtype_name(dtype) << " " << shape << ", got " << dtype_name(ck.dtype(name))
         << " " << IntArrayRef(ck.shape(name));
      problems.push_back(os.str());
    }
  };
  for (const auto& unit : units_) {
    for (size_t k = 0; k < unit->params.size(); ++k)
      expect("model." + names_[unit->params[k]], unit->shapes[k], kFloat32);
  }
  const auto buffers = module_->named_buffers();
  for (auto& [name, b] : buffers) expect("model." + name, b.sizes(), b.dtype());
  std::unordered_map<const TensorImpl*, size_t> index;
  for (size_t i = 0; i < params_.size(); ++i) index[params_[i].impl()] = i;
  if (opt) {
    for (const auto& group : opt->param_groups()) {
      for (const auto& [name, t] : group.params) {
        KILN_CHECK(index.count(t.impl()), ValueError, who, ": the optimizer holds '", name,
                   "', which is not a parameter of this FSDP module");
      }
    }
  }
  if (!problems.empty()) {
    std::ostringstream os;
    os << who << ": " << problems.size() << " problem(s), nothing loaded: ";
    for (size_t i = 0; i < problems.size(); ++i) os << (i ? "; " : "") << problems[i];
    throw ValueError(os.str());
  }
  // The optimizer's state for this rank's pieces, read before anything changes.
  optim::OptimizerStateDict local;
  if (opt) {
    for (size_t g = 0; g < opt->param_groups().size(); ++g) {
      optim::OptimizerStateDict::Group group;
      group.options = opt->param_groups()[g].options;
      for (auto& [hp, v] : group.options) {
        auto it = ck.metadata().find(group_key(g, hp));
        if (it != ck.metadata().end()) v = std::stod(it->second);
      }
      for (const auto& [name, t] : opt->param_groups()[g].params) {
        group.param_names.push_back(name);
        const size_t p = index.at(t.impl());
        const std::string prefix = "optim." + names_[p] + ".";
        if (!ck.contains(prefix + "step")) continue;  // no state saved for it
        const Unit& unit = *units_[unit_of_[p]];
        const size_t k = slot_of_[p];
        optim::ParamState st;
        st.step = ck.read(prefix + "step", 0, 1).data_ptr<int64_t>()[0];
        for (const auto& key : ck.names()) {
          if (key.rfind(prefix, 0) != 0 || key == prefix + "step") continue;
          const std::string state_key = key.substr(prefix.size());
          if (state_key.find('.') != std::string::npos) continue;  // a longer parameter name sharing the prefix
          MemoryCategoryGuard cat(MemoryCategory::OptimizerState);
          st.tensors[state_key] = ck.read(key, unit.piece_begin[k], unit.pieces[k].numel());
        }
        local.state[name] = std::move(st);
      }
      local.param_groups.push_back(std::move(group));
    }
  }
  NoGradGuard no_grad;
  for (const auto& unit : units_) {
    for (size_t k = 0; k < unit->params.size(); ++k) {
      Tensor piece = unit->pieces[k];
      piece.copy_(ck.read("model." + names_[unit->params[k]], unit->piece_begin[k], piece.numel()));
    }
    if (unit->state != Unit::State::Sharded) reshard(unit->index);  // the next gather brings the loaded values
  }
  for (auto& [name, b] : buffers) {
    Tensor t = b;
    t.copy_(ck.read_full("model." + name));
  }
  if (opt) opt->load_state_dict(local);
  return ck.metadata();
}

}  // namespace kiln::dist
