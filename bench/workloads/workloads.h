// The benchmark workloads of ../shared/bench/WORKLOADS.md in kiln, written with
// the public API as a user would (models from include/kiln/models, optimizers
// from kiln::optim). bench/torch/workloads.py holds their PyTorch twins.
//
// Data and initial parameters are "seed-free synthetic": every value is a
// closed-form hash of (tensor name, element index), computed in integers and
// double and rounded once to float32, so the kiln process and its PyTorch twin
// start from bitwise-identical weights and batches without exchanging files.
// That makes the first-step loss of both frameworks comparable in every run
// (the harness prints both), a cheap check that the twins compute the same
// model.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kiln/kiln.h"
#include "kiln/optim/optimizer.h"

namespace kiln_bench {

/// The hash behind every synthetic value (murmur3's fmix32 over i * golden ratio + salt):
/// element i of the tensor named `name` is fmix32((i * 0x9E3779B1 + fnv1a(name)) mod 2^32).
uint32_t fnv1a(const std::string& s);
uint32_t mix(uint64_t i, uint32_t salt);

/// Uniform values in [-scale, scale): (2 * mix(i, fnv1a(name)) / 2^32 - 1) * scale in double, then float32.
kiln::Tensor synthetic_uniform(const std::string& name, kiln::IntArrayRef sizes, double scale);
/// Integers mix(i, fnv1a(name)) mod n, int64 (class labels and token ids).
kiln::Tensor synthetic_classes(const std::string& name, kiln::IntArrayRef sizes, int64_t n);

/// Overwrites every parameter with the synthetic init both twins share:
///   dim >= 2 ("weight" of Linear/Conv/Embedding): uniform, scale 1/sqrt(fan_in), fan_in = numel / size(0)
///   1-d named "*weight" (norm scales): 1 + uniform(0.1);  other 1-d (biases): uniform(0.02)
void synthetic_init(kiln::nn::Module& model);

/// One workload: built once, then step() is what is timed.
class Workload {
 public:
  virtual ~Workload() = default;
  /// One training step (zero_grad, forward, loss, backward, optimizer step) or,
  /// for inference workloads, one forward pass. Returns the loss when
  /// `want_loss` (reading it back costs a sync that timed steps skip), else NaN.
  virtual double step(bool want_loss) = 0;
  /// The step as a function returning the loss (training) or the logits
  /// (inference): what step() runs, and what kiln_bench --compile on compiles.
  virtual std::function<kiln::Tensor()> step_fn() = 0;
  /// The loss a step's output stands for (a sync: read only when asked).
  virtual double loss_of(const kiln::Tensor& out) const { return out.item<float>(); }
  /// The model (compile guards its parameters and training mode).
  virtual kiln::nn::Module* module() = 0;
  /// Parameters of the model (what the table's notes quote).
  virtual int64_t num_parameters() const = 0;
  /// Model FLOPs per step when known (gpt: 6 N D + attention), else 0.
  virtual double flops_per_step() const { return 0; }
  /// Bytes an optimizer step must read and write back at least once: the
  /// float32 parameters and the optimizer's state tensors (momentum, Adam's
  /// moments) once a step has made them; 0 for inference (the floor table's
  /// state column, bench/floor_bench.py).
  virtual int64_t optimizer_state_bytes() const { return 0; }
};

/// The bytes of `model`'s parameters and of `opt`'s state tensors.
int64_t parameter_and_state_bytes(kiln::nn::Module& model, const kiln::optim::Optimizer& opt);

/// Runs the workloads' forward and loss under autocast to `dtype` (bf16 mixed
/// precision; parameters and optimizer stay float32), or in float32 when empty.
void set_autocast(std::optional<kiln::DType> dtype);

/// The names make_workload accepts, in the table's order.
const std::vector<std::string>& workload_names();
/// Builds a workload by name; throws kiln::ValueError for an unknown name.
std::unique_ptr<Workload> make_workload(const std::string& name);

/// Model FLOPs of one gpt training step (WORKLOADS.md): 6 * parameters * tokens
/// + 12 * layers * T^2 * d_model per sequence (attention, forward + backward).
double gpt_train_flops(int64_t params, int64_t batch, int64_t seq, int64_t layers, int64_t d_model);

}  // namespace kiln_bench
