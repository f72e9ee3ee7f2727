// The capture hook's description of elementwise loops, for kiln::compile's
// fusion (docs/compile.md, "Fusion").
//
// An elementwise kernel (unary, binary, compare, threshold_backward, copy,
// fill, where, ...) computes each element of its output from the elements at
// the same position of its inputs. When such a kernel is recorded it also
// notes its loop here: the iteration space, each operand's pointer, byte
// strides and element size, and a function that runs the same kernel over any
// part of that space. The compiler can then run several consecutive loops
// over the same space tile by tile — each tile of the first op, then the same
// tile of the next — so an intermediate is read back while it is still in
// cache, and one that nothing reads afterwards need not be written at all.
// Reductions of a whole array to one value (sum, mean, ...) note how they cut
// it (Reduction), so that such a run can end in the reduction of its result.
//
// Kept apart from capture.h because only the elementwise kernels and the
// compiler need it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>

namespace kiln::capture {

inline constexpr int kLoopDims = 16;     // as kernels::kMaxLoopDims
inline constexpr int kLoopOperands = 4;  // as kernels::kMaxOperands

/// An elementwise loop as the kernel ran it: dims innermost first, byte
/// strides; operand 0 is written, the others are read, element for element.
struct Loop {
  int ndim = 0;
  int nops = 0;
  int64_t sizes[kLoopDims] = {};
  int64_t strides[kLoopOperands][kLoopDims] = {};
  char* data[kLoopOperands] = {};
  int elem_size[kLoopOperands] = {};

  int64_t numel() const {
    int64_t n = 1;
    for (int d = 0; d < ndim; ++d) n *= sizes[d];
    return n;
  }
};

/// Copies the dims and operands in use (not the element sizes) from one loop
/// description to another: Loop and the kernels' LoopSpec have these fields.
template <typename To, typename From>
void copy_loop_shape(To& to, const From& from) {
  to.ndim = from.ndim;
  to.nops = from.nops;
  for (int d = 0; d < from.ndim; ++d) to.sizes[d] = from.sizes[d];
  for (int op = 0; op < from.nops; ++op) {
    for (int d = 0; d < from.ndim; ++d) to.strides[op][d] = from.strides[op][d];
    to.data[op] = from.data[op];
  }
}

/// Runs the recorded kernel over a part of its loop (same operands and
/// strides, a sub-range of the space, or the operands moved elsewhere).
using LoopRun = std::function<void(const Loop&)>;

/// A reduction of every element of a contiguous array to one value, as the
/// kernel computes it (the reduction kernels' Note [Deterministic reductions]):
/// the array is cut into pieces of `piece` elements, each piece reduced to an
/// accumulator of `acc_size` bytes, and the accumulators combined by a tree
/// that depends only on their count. A fused loop that produces the array tile
/// by tile can reduce each tile's pieces while they are in cache, and get the
/// kernel's bits.
struct Reduction {
  const char* in = nullptr;
  int64_t numel = 0;
  int elem_size = 0;
  int64_t piece = 0;
  int acc_size = 0;
  /// Reduces the `n` (at most `piece`) elements at `p` into the accumulator at `acc`.
  std::function<void(const char* p, int64_t n, void* acc)> reduce_piece;
  /// Combines `pieces` accumulators (in order) and writes the kernel's output.
  std::function<void(const void* accs, int64_t pieces)> finish;
};

/// A kernel that is not elementwise, described for kiln::compile's graph
/// rewrites (docs/compile.md, "Rewrites"): what it computes, the buffers it
/// reads and writes, and a function that runs the same kernel on other
/// buffers of the same sizes.
inline constexpr int kKernelOperands = 5;
struct Operands;
using OperandsRun = std::function<void(const Operands&)>;
/// Set by a kernel that can run joined with the kernel recorded right after
/// it (a rewrite of kiln::compile): given its own Operands and the next
/// kernel's, the joined kernel's operands and how to run it, or nothing where
/// the two do not join. The kernels layer decides, from both kernels' params.
using OperandsJoin = std::optional<std::pair<Operands, OperandsRun>> (*)(const Operands& self, const Operands& next);
struct Operands {
  const char* what = nullptr;  // a literal naming the computation ("max_pool_nhwc_forward")
  int n = 0;
  void* ptr[kKernelOperands] = {};
  int64_t bytes[kKernelOperands] = {};  // each buffer's extent from ptr
  // A parameter a rewrite passes to a kernel that takes one (the max pool's
  // fused ReLU: its backward's threshold); what it means is the kernel's to say.
  bool has_scalar = false;
  double scalar = 0;
  // The kernel's own parameters (shapes, strides), opaque above the kernels
  // layer: a rewrite that joins two kernels hands both Operands back to the
  // kernels layer, which reads them.
  std::shared_ptr<const void> params = nullptr;
  OperandsJoin join_next = nullptr;
};

/// Implemented by the compiler: describes the kernel it was just handed.
class LoopSink {
 public:
  virtual ~LoopSink() = default;
  virtual void loop(const Loop& loop, LoopRun run) = 0;
  virtual void reduction(Reduction r) = 0;
  virtual void operands(const Operands& o, OperandsRun run) {
    (void)o;
    (void)run;
  }
  /// The scalar parameter of the elementwise kernel just noted (threshold_backward's threshold).
  virtual void scalar(double v) { (void)v; }
};

namespace detail {
extern constinit thread_local LoopSink* t_loop_sink;
}  // namespace detail

/// Called by a kernel right after it recorded itself (KernelScope::record).
inline void note_loop(const Loop& loop, LoopRun run) {
  if (detail::t_loop_sink) detail::t_loop_sink->loop(loop, std::move(run));
}

/// Called by a reduction kernel right after it recorded itself.
inline void note_reduction(Reduction r) {
  if (detail::t_loop_sink) detail::t_loop_sink->reduction(std::move(r));
}

/// Called by a kernel right after it recorded itself, for the rewrites.
inline void note_operands(const Operands& o, OperandsRun run) {
  if (detail::t_loop_sink) detail::t_loop_sink->operands(o, std::move(run));
}

/// Called by an elementwise kernel right after note_loop.
inline void note_scalar(double v) {
  if (detail::t_loop_sink) detail::t_loop_sink->scalar(v);
}

/// RAII: installs `sink` on this thread for the duration of a capture.
class LoopSinkGuard {
 public:
  explicit LoopSinkGuard(LoopSink* sink) noexcept : prev_(detail::t_loop_sink) { detail::t_loop_sink = sink; }
  ~LoopSinkGuard() { detail::t_loop_sink = prev_; }
  LoopSinkGuard(const LoopSinkGuard&) = delete;
  LoopSinkGuard& operator=(const LoopSinkGuard&) = delete;

 private:
  LoopSink* prev_;
};

}  // namespace kiln::capture
