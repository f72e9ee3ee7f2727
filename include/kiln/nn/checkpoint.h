// Activation checkpointing, as torch.utils.checkpoint.checkpoint(fn, *args,
// use_reentrant=False): trade compute for memory by keeping only a segment's
// inputs through the forward pass and recomputing the segment in backward.
//
//   Tensor y = nn::checkpoint([&](const Tensor& x) { return block->forward(x); }, x);
//   y.sum().backward();  // block's forward runs again here, then its backward
//
// The recomputation restores the default Generator's state (dropout draws the
// same masks) and the autocast state the forward saw, so gradients are bitwise
// those of the uncheckpointed model. Tensors fn captures (a module's
// parameters, a tensor computed before the segment) get their gradients
// through Tensor::backward and autograd::grad alike, whether or not the inputs
// require grad. Under NoGradGuard checkpoint just runs fn. How it works and
// what it costs: docs/memory.md, "Activation checkpointing".
#pragma once

#include <concepts>
#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kiln/core/tensor.h"
#include "kiln/nn/module.h"

namespace kiln::nn {

/// A checkpointed segment: the segment's inputs -> its outputs. It must be
/// deterministic apart from the default Generator (it runs again in backward);
/// a second run whose outputs differ in count, shape or dtype, or that reads
/// other tensors needing grad than the first did, is a ValueError naming the
/// segment.
using CheckpointFn = std::function<TensorList(const TensorList&)>;

/// Runs fn(inputs) keeping none of its intermediate activations for backward.
/// `name` labels the segment in errors ("transformer.h.3"); empty: described by its input shapes.
TensorList checkpoint(const CheckpointFn& fn, const TensorList& inputs, const std::string& name = {});

/// checkpoint(fn, x, y, ...) with fn taking the tensors one by one and
/// returning a Tensor or a TensorList. fn is copied and kept until backward.
template <typename F, typename... Ts>
requires(sizeof...(Ts) > 0 && (std::same_as<std::decay_t<Ts>, Tensor> && ...)) auto checkpoint(F&& fn,
                                                                                               const Ts&... inputs) {
  using R = std::invoke_result_t<F&, const Ts&...>;
  static_assert(std::is_same_v<R, Tensor> || std::is_same_v<R, TensorList>,
                "nn::checkpoint: fn must return a Tensor or a TensorList");
  CheckpointFn wrapped = [f = std::decay_t<F>(std::forward<F>(fn))](const TensorList& in) mutable -> TensorList {
    return [&]<size_t... I>(std::index_sequence<I...>)->TensorList {
      if constexpr (std::is_same_v<R, Tensor>)
        return {f(in[I]...)};
      else
        return f(in[I]...);
    }
    (std::index_sequence_for<Ts...>{});
  };
  TensorList out = checkpoint(wrapped, TensorList{inputs...});
  if constexpr (std::is_same_v<R, Tensor>)
    return out[0];
  else
    return out;
}

/// True while a checkpointed segment is being recomputed in backward on this
/// thread: a segment that updates state in forward (BatchNorm's running
/// statistics) can use it to avoid counting the batch twice.
bool is_recomputing();

/// torch.utils.checkpoint.checkpoint_sequential: runs `modules` in order on x,
/// split into `segments` runs of consecutive modules (the last ones take the
/// remainder); every segment but the last is checkpointed, as torch's (the
/// last one's activations are needed at once by backward anyway).
Tensor checkpoint_sequential(const std::vector<ModulePtr>& modules, int64_t segments, const Tensor& x);
/// The children of `seq` (an nn::Sequential) as the modules.
Tensor checkpoint_sequential(const Module& seq, int64_t segments, const Tensor& x);

/// Which blocks of a model to checkpoint (the zoo's GPT, ViT and ResNet; `kiln
/// train`'s train.activation_checkpointing): none, each block, or runs of k.
struct CheckpointPolicy {
  /// 0: none; k >= 1: the blocks in consecutive runs of k (the last run takes
  /// the remainder), each run but the last one checkpointed segment, so only
  /// every k-th block's input is kept (k = 1: every block; larger k keeps
  /// fewer inputs but recomputes k blocks' activations at once in backward).
  /// The last run is not checkpointed, as in checkpoint_sequential: backward
  /// needs its activations first, so recomputing them would only cost time.
  int64_t every = 0;
  static CheckpointPolicy none() { return {}; }
  static CheckpointPolicy blocks() { return {1}; }
  /// k >= 1, else a ValueError.
  static CheckpointPolicy every_k(int64_t k);
  bool enabled() const { return every > 0; }
};

/// Runs blocks [0, n) in order on x under `policy` (the last run plain):
/// block(i, x) -> the output of block i; segments are named "<prefix>.<first>"
/// or "<prefix>.<first>-<last>".
Tensor run_blocks(const CheckpointPolicy& policy, int64_t n, const std::function<Tensor(int64_t, const Tensor&)>& block,
                  const Tensor& x, const std::string& prefix);

}  // namespace kiln::nn
