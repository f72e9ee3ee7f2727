// quant: pruning (issue 22), as torch.nn.utils.prune, in two forms.
//
// Unstructured (l1_unstructured, global_unstructured, remove): the weights of
// smallest magnitude are set to zero and kept there. Torch reparametrizes
// (weight_orig and weight_mask, weight = weight_orig * weight_mask recomputed
// in a forward pre-hook). kiln's layers hold `Tensor& weight` into their
// parameter slot, which the optimizer and load_state_dict follow, so the
// parameter stays `weight` and is masked IN PLACE instead:
//   - the mask is a non-persistent buffer "<name>_mask" (1 kept, 0 pruned), so
//     state_dict() of a pruned model is the dense layout with zeros, loadable
//     by a model that was never pruned;
//   - a gradient hook multiplies the parameter's gradient by the mask, so
//     momentum and Adam's moments never accumulate on a pruned weight;
//   - a forward pre-hook multiplies the weight by the mask again whenever the
//     weight changed since the last time (its version counter moved): what an
//     optimizer does to a pruned weight beyond its gradient (SGD's momentum
//     from before pruning, Adam's bias-corrected moments, decoupled weight
//     decay) is undone before the weight is read.
// remove() makes it permanent: the weight is masked once more and the hooks
// and the mask buffer go (the parameter is a plain dense parameter again).
//
// Which elements: the `round(amount · n)` unpruned elements of smallest |w|
// (n counts the elements not pruned yet, as torch's PruningContainer when a
// tensor is pruned again; Python's round, half to even). Among equal |w| at
// the threshold kiln prunes the lowest flat index first; torch's topk leaves
// that order to its selection algorithm, so the two agree on every element
// except which of several exactly equal magnitudes at the threshold go
// (tests/quant/test_prune.cpp checks both halves of that statement).
//
// Structured channel pruning shrinks the layers for real: the channels with
// the smallest L1 norm (torch's ln_structured(n=1, dim=0) ranking, ties to the
// lower index) are taken out of the producing layer and out of every layer
// that reads them, for
//   models::CNN: conv1's and conv2's filters and fc1's units (units
//     "conv1", "conv2", "fc1"), fc2 keeps its classes;
//   models::ResNet: each BasicBlock's inner channels (conv1's filters, bn1,
//     conv2's input channels; unit "layer<s>.<b>"), so the residual shapes stay.
// mask_channels() is the same choice as zeros (the layers keep their shapes,
// and for a ResNet bn1's weight and bias of a dropped channel are zeroed so the
// channel is 0 after bn1): its outputs equal the shrunk model's.
// A shrunk model's architecture is saved as JSON {"unit": kept, ...} in the
// safetensors metadata key kPrunedChannelsKey; shape_pruned_channels() builds
// that architecture in a fresh model before its state_dict is loaded.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kiln/core/tensor.h"
#include "kiln/nn/module.h"

namespace kiln::quant {

// ---- unstructured ----

/// The mask torch's L1Unstructured(amount).compute_mask(t, default_mask) gives
/// (float32, t's shape): among the elements where default_mask is 1 (all when
/// undefined), the round(amount · count) of smallest |t| become 0 (ties: the
/// lower flat index first). amount in [0, 1] (ValueError otherwise).
Tensor l1_unstructured_mask(const Tensor& t, double amount, const Tensor& default_mask = {});

/// Prunes module.<name> (a float32 parameter) by L1 magnitude, as
/// torch.nn.utils.prune.l1_unstructured; a tensor pruned before is pruned
/// further among the weights it still has.
void l1_unstructured(nn::Module& module, const std::string& name, double amount);

/// As torch.nn.utils.prune.global_unstructured(params, L1Unstructured, amount):
/// one threshold over all the tensors together (flattened in the given order).
void global_unstructured(const std::vector<std::pair<nn::Module*, std::string>>& params, double amount);

/// Whether module.<name> is pruned (has a mask and its hooks).
bool is_pruned(nn::Module& module, const std::string& name);

/// As torch.nn.utils.prune.remove: the zeros stay, the mask and hooks go.
/// ValueError if module.<name> is not pruned.
void remove(nn::Module& module, const std::string& name);

/// Every pruned parameter of `model` and its descendants, made permanent.
/// Returns how many were removed.
int64_t remove_all(nn::Module& model);

/// Every Conv2d and Linear weight of `model` ("conv1", "layer1.0.conv1", ...),
/// the tensors kiln prune works on.
std::vector<std::pair<std::string, nn::Module*>> prunable_layers(nn::Module& model);

struct LayerSparsity {
  std::string layer;  // module path
  int64_t zeros = 0, numel = 0;
  double fraction() const { return numel ? static_cast<double>(zeros) / static_cast<double>(numel) : 0.0; }
};
/// The share of exact zeros in every prunable layer's weight, in model order.
std::vector<LayerSparsity> weight_sparsity(nn::Module& model);

// ---- structured (channels) ----

/// Kept channels per unit (see the header comment for the unit names).
using ChannelCounts = std::map<std::string, int64_t>;

/// The metadata key holding a shrunk model's ChannelCounts as JSON.
inline constexpr const char* kPrunedChannelsKey = "kiln.pruned_channels";

/// The `keep` rows of `weight` (dim 0) with the largest L1 norm over the other
/// dims, as torch's LnStructured(n=1, dim=0) ranks them (ties: lower index
/// first), returned in ascending index order.
std::vector<int64_t> l1_top_channels(const Tensor& weight, int64_t keep);

/// n - round(amount · n): what a unit of n channels keeps (ValueError when
/// amount is outside [0, 1) or nothing would be kept).
int64_t channels_to_keep(int64_t n, double amount);

/// Drops the share `amount` of every unit's channels (lowest L1 norm) and
/// replaces the layers by smaller ones holding the kept channels' weights.
/// models::CNN and models::ResNet only (ValueError for other models). Returns
/// the units' kept counts.
ChannelCounts prune_channels(nn::Module& model, double amount);

/// The same channels as prune_channels(model, amount) set to zero in place
/// (conv filter and bias; for a ResNet also bn1's weight and bias), shapes
/// unchanged: the masked twin the shrunk model must equal.
void mask_channels(nn::Module& model, double amount);

/// Gives a fresh model of the run's architecture the shrunk layer shapes of
/// `counts` (their values are to be loaded next with load_state_dict).
/// ValueError naming the unit for an unknown unit, a count below 1 or above
/// the layer's, or a model kind with no channel pruning.
void shape_pruned_channels(nn::Module& model, const ChannelCounts& counts);

/// {"conv1":24,...} and back. parse_channel_counts raises FormatError naming
/// `source` for anything but a JSON object of unit names to integers.
std::string channel_counts_json(const ChannelCounts& counts);
ChannelCounts parse_channel_counts(const std::string& json, const std::string& source);

/// The units' current channel counts of a CNN or ResNet (as built or shrunk).
ChannelCounts channel_counts(nn::Module& model);

}  // namespace kiln::quant
