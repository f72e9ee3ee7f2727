// The PyTorch oracle (DESIGN.md §9): evaluates torch expressions over kiln
// tensors in /usr/bin/python3 with torch 1.13, ONE interpreter run per batch.
//
//   test::OracleBatch b;
//   size_t i = b.add("add_f32_broadcast", "torch.add(x0, x1, alpha=2)", {a, c});
//   b.run();                                   // one python run (or the cache)
//   const test::OracleOutcome& r = b.outcome(i);   // r.ok, r.outputs / r.error
//
// Inputs travel in one safetensors file (values and strides: the oracle
// rebuilds the same layout, expanded dims included) with a JSON manifest;
// outputs come back in one safetensors file. Results are cached under the
// build dir, keyed by a hash of oracle.py, the manifest and the input bytes,
// so re-runs do not pay torch's ~3 s import. A torch exception fails only
// its case. If python or torch is missing, run() throws with the fix (run
// scripts/setup.sh): tests fail, they never skip.
#pragma once

#include <string>
#include <vector>

#include "kiln/core/tensor.h"

namespace kiln::test {

struct OracleOutcome {
  bool ok = false;
  std::string error;            // "RuntimeError: ..." when torch raised
  std::vector<Tensor> outputs;  // one per returned tensor / tuple element / Python number (undefined for None)
  std::vector<bool> is_number;  // true where Python returned an int, float or bool (a 0-dim tensor here)
  /// Gradient cases (add_grad): per output of the expression, whether it required grad in torch.
  std::vector<bool> output_requires_grad;
};

class OracleBatch {
 public:
  /// Adds a case over inputs x0, x1, ... (their values are copied now). Returns its index.
  size_t add(std::string id, std::string torch_expr, const std::vector<Tensor>& inputs);
  /// Adds a gradient case: torch.autograd.grad of the expression's outputs with respect to
  /// x_i for i in grad_inputs (made leaves that require grad, same layout), with
  /// grad_outputs[k] as the gradient of output k (undefined: output k is not
  /// differentiated), allow_unused=True. The outcome has one output per grad input,
  /// undefined where torch returned None, and output_requires_grad per output.
  size_t add_grad(std::string id, std::string torch_expr, const std::vector<Tensor>& inputs,
                  const std::vector<int>& grad_inputs, const std::vector<Tensor>& grad_outputs);
  size_t size() const { return cases_.size(); }

  /// Evaluates every case: from the cache, or in one python run. Throws
  /// std::runtime_error when the oracle cannot run at all.
  void run();
  bool ran() const { return ran_; }
  bool from_cache() const { return from_cache_; }
  const OracleOutcome& outcome(size_t i) const;

 private:
  struct Case {
    std::string id, expr;
    std::vector<std::string> input_names;
    std::vector<std::vector<int64_t>> input_strides;
    bool grad = false;
    std::vector<int> grad_inputs;
    std::vector<std::string> grad_output_names;  // "" where undefined
  };
  std::string manifest_json() const;

  std::vector<Case> cases_;
  std::vector<std::pair<std::string, Tensor>> inputs_;
  std::vector<OracleOutcome> outcomes_;
  bool ran_ = false;
  bool from_cache_ = false;
};

/// Evaluates one expression (a batch of one; cached like any batch).
OracleOutcome torch_eval(const std::string& torch_expr, const std::vector<Tensor>& inputs = {});

/// The torch spelling of a dtype: "torch.float32", "torch.bfloat16", ...
std::string torch_dtype(DType dt);

}  // namespace kiln::test
