// The registry driver's backward checks (tests/ops/test_op_registry.cpp), as
// functions that return their failures, so the driver's own test can feed
// them right and wrong backward formulas.
//
// For a sample with grad_inputs:
//   1. kiln vs PyTorch: the grad inputs become leaves that require grad (same
//      layout as the sample's tensors, which stay untouched), the sample runs,
//      and kiln::autograd::grad of its outputs for deterministic random
//      grad_outputs (one per floating output) is compared with
//      torch.autograd.grad of the sample's expression for the same
//      grad_outputs. An undefined kiln gradient equals a None or all-zero one.
//   2. gradcheck: the sample's floating inputs as float64, the grad inputs
//      requiring grad, kiln::autograd::gradcheck of the sample's run function;
//      fast mode (u^T J v) when the grad inputs or the outputs hold more than
//      kFastModeNumel elements.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "ops/specs/op_spec.h"
#include "support/oracle.h"

namespace kiln::test {

/// gradcheck switches to fast mode above this many elements (grad inputs, or outputs).
inline constexpr int64_t kFastModeNumel = 64;

/// A sample's gradient case, prepared when the oracle batch is built.
struct GradCase {
  std::string error;          // kiln's forward threw while preparing (reported by the check)
  TensorList grad_outputs;    // one per kiln output; undefined for non-floating outputs
  size_t oracle_case = std::numeric_limits<size_t>::max();
};

/// Runs kiln's forward once (for the outputs' shapes and dtypes), draws the
/// grad_outputs from a generator seeded by `id`, and adds the torch gradient
/// case to `oracle`.
GradCase add_grad_case(OracleBatch& oracle, const std::string& id, const ops::OpSample& s);

/// The tolerance for comparing gradients with torch's: spec.grad_tolerance if
/// set, else the forward tolerance (spec's or the dtype's default); for
/// float32 at least rtol 1e-4 / atol 1e-5, since a gradient chains several
/// float32 roundings (products with saved values, sums over broadcast dims)
/// that torch may order differently.
ops::Tolerance grad_tolerance(const ops::OpSpec& spec, DType dt);

/// Checks 1 above; returns the failures (empty when kiln agrees with torch).
std::vector<std::string> check_grad_against_torch(const std::string& op, const ops::OpSample& s,
                                                  const GradCase& c, const OracleOutcome& want,
                                                  ops::Tolerance tol);

/// Checks 2 above; returns the failures (empty when gradcheck passes).
std::vector<std::string> check_gradcheck(const std::string& op, const ops::OpSample& s);

/// Problems with a sample's grad_inputs themselves (out of range, not floating, repeated).
std::vector<std::string> grad_inputs_problems(const ops::OpSample& s);

/// "x0: float32[3, 4], x1: float32[4] strides [2]" for messages.
std::string describe_inputs(const std::vector<Tensor>& inputs);

}  // namespace kiln::test
