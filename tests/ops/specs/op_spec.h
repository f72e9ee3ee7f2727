// The op registry (DESIGN.md §4, §9): one declarative entry per op drives
// every generic op test — forward against the PyTorch oracle, (with autograd)
// backward against float64 central differences, non-contiguous and broadcast
// inputs, error inputs.
//
// The entries live with the tests, one file per op family
// (tests/ops/specs/<family>_spec.cpp), and are built into the static library kiln_op_specs that only the test
// binaries link: they are test data, not library code, so they are neither
// compiled into kiln_ops nor installed, and they may use any public header
// (nn included) to reach the op under test.
//
// A sample is self-contained: its input tensors, how kiln computes the
// result, and the same computation as a Python expression over `x0, x1, ...`
// (torch tensors) that the oracle evaluates. Keeping the Python beside the
// C++ makes a mismatch in arguments visible in one place.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "kiln/core/tensor.h"

namespace kiln::ops {

struct OpSample {
  std::string label;                 // "broadcast", "noncontig", "dim=-1 keepdim"...
  std::vector<Tensor> inputs;        // x0, x1, ...
  std::function<std::vector<Tensor>(const std::vector<Tensor>&)> run;  // kiln's result(s)
  std::string torch;                 // e.g. "torch.add(x0, x1, alpha=2)"; a tuple for several outputs
  /// Inputs that backward checks differentiate (indices into inputs, floating inputs only);
  /// empty: none. Checked only when the spec is `differentiable` (see OpSpec).
  std::vector<int> grad_inputs;
  /// false: skip the float64 gradcheck of this sample (the kiln-vs-PyTorch gradient
  /// check still runs). A documented opt-out for points where the op is not
  /// differentiable and torch's own gradcheck would fail too (a kink: relu at 0,
  /// abs at 0, max with ties); say why in the sample's label or a comment.
  bool gradcheck = true;
};

struct OpErrorCase {
  std::string label;
  std::function<void()> run;          // must throw
  std::string error_type;             // "ShapeError", "DTypeError", "IndexError", "ValueError"
  std::string message_contains;       // a substring the message must hold
};

struct Tolerance {
  double rtol = 1e-5;
  double atol = 1e-6;
};

struct OpSpec {
  std::string name;
  std::vector<DType> dtypes;
  /// Sample inputs for one dtype; include broadcast and non-contiguous cases.
  std::function<std::vector<OpSample>(DType)> samples;
  /// Tolerance for comparing with PyTorch at a dtype (defaults by dtype if unset).
  std::function<Tolerance(DType)> tolerance;
  std::function<std::vector<OpErrorCase>()> errors;
  /// The op has a backward: the registry driver (tests/ops/test_op_registry.cpp) then
  /// checks, for every floating sample with grad_inputs, kiln's gradients against
  /// torch.autograd.grad for the same random grad_outputs ("<op>_<dtype>_grad"), and
  /// a float64 gradcheck (fast mode for large samples). false (the default until every
  /// family has its backward): grad_inputs are not checked. The sanity test requires
  /// every differentiable spec to have at least one sample with grad_inputs.
  bool differentiable = false;
  /// Tolerance for the gradient comparison with PyTorch (defaults: `tolerance`, or the
  /// dtype's default, loosened for float32 to rtol 1e-4 / atol 1e-5).
  std::function<Tolerance(DType)> grad_tolerance = {};
};

/// Default tolerances: exact for integers/bool, 1e-5/1e-6 float32, 1e-10 float64,
/// 1.6e-2/1e-2 bfloat16, 1e-3/1e-3 float16.
Tolerance default_tolerance(DType dt);

/// Every registered op, in family order. Built on first use.
const std::vector<OpSpec>& op_registry();

// Each tests/ops/specs/<family>_spec.cpp defines its entries through one of these.
void register_factory_ops(std::vector<OpSpec>& r);
void register_view_ops(std::vector<OpSpec>& r);
void register_index_ops(std::vector<OpSpec>& r);
void register_elementwise_ops(std::vector<OpSpec>& r);
void register_reduction_ops(std::vector<OpSpec>& r);
void register_linalg_ops(std::vector<OpSpec>& r);
void register_conv_pool_ops(std::vector<OpSpec>& r);
void register_norm_loss_attention_ops(std::vector<OpSpec>& r);

/// Deterministic sample data: a tensor of `sizes` in `dt` from a fixed-seed
/// generator keyed by `seed`, values normal(0,1) for floats, [-5, 5) for ints.
Tensor sample_tensor(IntArrayRef sizes, DType dt, uint64_t seed);
/// As sample_tensor, but non-contiguous: a transposed or strided view with the given sizes.
Tensor sample_noncontig(IntArrayRef sizes, DType dt, uint64_t seed);
/// Positive values in [lo, hi) (for log, sqrt, pow bases...).
Tensor sample_positive(IntArrayRef sizes, DType dt, uint64_t seed, double lo = 0.5, double hi = 2.0);

}  // namespace kiln::ops
