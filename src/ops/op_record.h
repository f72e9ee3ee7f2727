// Internal to the ops layer: how a public op shows up in a profile.
//
// Each public op opens one OpScope at its entry, named as PyTorch's aten op
// without the prefix ("add", "mm", "conv2d"), with its tensor operands
// (Scalars are not inputs; pass null for them). Ops that call other public
// ops nest, as torch shows aten::linear above aten::addmm; the profiler's self
// time separates them. With nothing listening a scope is one flag test: the
// names are literals and the FLOP counts below are computed only when
// rs.recording().
//
// Listeners read the inputs when the scope closes (their shapes and dtypes):
// every tensor passed must stay alive and defined until then, so never pass
// one the op moves from, or a local it returns (the return moves it out
// before the scope's destructor runs); close the scope first instead.
//
// FLOPs follow torch's with_flops: a multiply-add is 2.
//
// While kiln::compile captures on this thread, the scope also tells its
// recorder which op the kernels inside belong to (kiln/core/capture_ops.h):
// one more thread-local test at entry.
#pragma once

#include <initializer_list>
#include <string_view>
#include <vector>

#include "kiln/core/capture_ops.h"
#include "kiln/core/record.h"
#include "kiln/core/tensor.h"

namespace kiln::ops {

/// An op name handed down as a pointer (a family's shared implementation gets
/// "exp" or "abs_" from its caller): measured only when recording.
struct NamePtr {
  const char* name;
};

class OpScope : public record::Scope {
 public:
  /// `name` a literal: its length is known at compile time.
  OpScope(std::string_view name, std::initializer_list<const Tensor*> inputs) noexcept
      : record::Scope(record::Kind::Op, name, inputs) {
    enter(name);
  }
  OpScope(NamePtr name, std::initializer_list<const Tensor*> inputs) noexcept
      : record::Scope(record::Kind::Op, record::active() ? std::string_view(name.name) : std::string_view(), inputs) {
    enter(name.name);
  }
  ~OpScope() {
    if (sink_) sink_->op_exit();
  }

 private:
  void enter(std::string_view name) noexcept {
    sink_ = capture::detail::t_op_sink;
    if (sink_) sink_->op_enter(name);
  }
  capture::OpSink* sink_ = nullptr;
};

/// The i-th tensor of a list, or null past its end (a list op's recorded inputs).
inline const Tensor* nth_input(const std::vector<Tensor>& ts, size_t i) { return i < ts.size() ? &ts[i] : nullptr; }

/// 2·M·N·K for a product [..., M, K] · [..., K, N] giving `out`: the output's
/// elements times 2·K. Valid for mm, bmm, matmul (broadcast batches included:
/// out has them) and linear.
inline double product_flops(const Tensor& out, int64_t k) {
  return 2.0 * static_cast<double>(out.numel()) * static_cast<double>(k);
}

/// 2·N·Cout·Hout·Wout·(Cin/groups)·kH·kW for a convolution giving `out`
/// ([N, Cout, Hout, Wout] or unbatched [Cout, Hout, Wout]) with `weight`
/// [Cout, Cin/groups, kH, kW].
inline double conv_flops(const Tensor& out, const Tensor& weight) {
  const double per_output = static_cast<double>(weight.numel() / weight.size(0));  // (Cin/groups)·kH·kW
  return 2.0 * static_cast<double>(out.numel()) * per_output;
}

}  // namespace kiln::ops
