#pragma once
// FSDP internals shared by fsdp.cpp (gather, reshard, reduce), fsdp_layout.cpp
// (which parameters form which unit, and that every rank agrees) and
// fsdp_state.cpp (full state dicts).
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kiln/dist/fsdp.h"

namespace kiln::dist {

struct FullyShardedDataParallel::Unit {
  enum class State { Sharded, Gathering, Gathered };
  size_t index = 0;
  nn::Module* module = nullptr;       // null: the root unit
  std::vector<size_t> params;         // indices into FullyShardedDataParallel::params_
  std::vector<DimVector> shapes;      // each parameter's full shape
  std::vector<int64_t> offsets;       // each parameter's first element in the flat range
  std::vector<int64_t> piece_begin;   // first element of the parameter held in this rank's shard
  std::vector<int64_t> piece_offset;  // where that piece sits in the shard
  std::vector<Tensor> pieces;         // 1-D views of shard_tensor (what the parameters are between steps)
  std::vector<Tensor> full_views;     // shaped views of `full` (what they are while gathered)
  int64_t numel = 0, shard = 0;
  int64_t trainable = 0;  // parameters that require grad
  Tensor shard_tensor;    // this rank's float32 master shard
  Tensor full;            // N * shard elements; its storage is released while sharded
  State state = State::Sharded;
  WorkPtr gather_work;
  // Backward.
  int64_t pending = 0;  // trainable parameters still without their gradient
  bool launched = false;
  bool called = false;         // ran in this forward
  bool backward_done = false;  // its gradients are reduced (or reducing): no regather
  Tensor reduce_in, reduce_out;
  WorkPtr reduce_work;
  Tensor grad_shard;  // the reduced gradient, shard elements; undefined before the first backward
};

namespace detail {

struct PlannedUnit {
  std::string name;                                    // "(root)" for the root unit
  nn::Module* module = nullptr;                        // null for the root unit
  std::vector<std::pair<std::string, Tensor>> params;  // in registration order
};
struct FSDPLayout {
  std::vector<PlannedUnit> units;  // the root first (when it has parameters), then the units as listed
};

/// Finds each named unit, checks that units do not nest and that parameters
/// are float32 and contiguous, and assigns each parameter to the one unit that
/// holds it (a parameter inside several units goes to the root).
FSDPLayout plan_units(nn::Module& model, const std::vector<std::string>& unit_names);

/// A collective: every rank's units (names and sizes) are compared; on any
/// difference every rank throws the same DistributedError naming the group,
/// the first differing unit and the ranks.
void check_same_layout(ProcessGroup& group, const FSDPLayout& layout);

}  // namespace detail
}  // namespace kiln::dist
