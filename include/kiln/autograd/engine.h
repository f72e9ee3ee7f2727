// Running backward: Tensor::backward and autograd::grad (DESIGN.md §3).
//
// The engine is iterative (no recursion: a graph of any depth is safe), runs
// each node once all gradients for it have arrived, and among ready nodes
// runs the most recently created first, as PyTorch does. It checks every
// gradient a node returns against the shape and dtype of the input it
// belongs to, summing broadcast dims, and names the node on a mismatch.
#pragma once

#include <functional>
#include <optional>
#include <vector>

#include "kiln/core/tensor.h"

namespace kiln::autograd {

/// Accumulates d(sum of tensors[i] * grad_tensors[i]) into the .grad of the
/// leaves. grad_tensors may be empty when every tensor is a scalar.
void backward(const TensorList& tensors, const TensorList& grad_tensors = {}, bool retain_graph = false,
              bool create_graph = false);

/// Returns d(outputs)/d(inputs) without touching any .grad. With allow_unused,
/// an input that does not reach the outputs gets an undefined tensor;
/// otherwise that is an error naming the input.
TensorList grad(const TensorList& outputs, const TensorList& inputs, const TensorList& grad_outputs = {},
                std::optional<bool> retain_graph = std::nullopt, bool create_graph = false, bool allow_unused = false);

/// Queues `fn` to run on this thread once the current backward()/grad() has
/// finished, after every gradient was accumulated (torch's
/// Variable._execution_engine.queue_callback). Only valid while a backward
/// pass runs, e.g. from a hook: DDP uses it to wait for its allreduces.
/// Callbacks run in the order queued; one that throws ends backward() with
/// its error and the remaining callbacks are dropped.
void queue_callback(std::function<void()> fn);

}  // namespace kiln::autograd
