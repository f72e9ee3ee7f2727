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

#include "kiln/autograd/node.h"
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

/// For activation checkpointing (nn::checkpoint, docs/memory.md): back-propagates
/// `grad_outputs` (undefined: no gradient for that output) from `outputs` through
/// the graph above `boundary` only, and returns the gradient arriving at each
/// boundary edge (undefined where none arrives). Boundary nodes are neither run
/// nor have their hooks fired, and nothing beyond them is visited: the caller's
/// own backward pass does that with what is returned. Every AccumulateGrad the
/// graph reaches must be a boundary node, so no .grad is touched. Safe to call
/// from inside a node's apply (a nested pass with its own state); callbacks
/// queued by its hooks run when the enclosing backward ends.
TensorList grad_to_boundary(const TensorList& outputs, const TensorList& grad_outputs,
                            const std::vector<Edge>& boundary, bool create_graph);

}  // namespace kiln::autograd
