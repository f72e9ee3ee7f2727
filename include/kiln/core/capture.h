// The capture hook (core): how kiln::compile records a step once and replays
// it without dispatch, autograd bookkeeping or allocation (docs/compile.md).
//
// While a Recorder is installed on a thread, the step runs eagerly as usual,
// and three kinds of event reach the recorder:
//   - kernels: every public kernel entry (src/kernels) opens a KernelScope
//     and, when it is the outermost one, hands over a closure that calls the
//     kernel again with copies of its arguments (the raw pointers and strides
//     it was given). Nested kernels are not recorded: the outer one does them.
//   - host actions: host-side effects that replay must repeat by running host
//     code again (an optimizer's step with its step counters and learning
//     rate, zero_grad, AccumulateGrad setting a leaf's .grad). Kernels run
//     inside a host action are not recorded; its allocations do not come from
//     the capture's private pool.
//   - graph breaks: something that replay cannot repeat — a read of tensor
//     data on the host whose value may steer what follows (item(), nonzero),
//     random numbers, a collective — is reported with what it was and where.
//
// Replay is valid only because every tensor the step makes lives in the
// capture's private memory pool (memory::PrivatePool): the addresses the
// closures hold stay reserved for the compiled step, as a CUDA graph's do.
//
// With no recorder (the normal case) a KernelScope is one thread-local load
// and a branch.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>

namespace kiln {
class Tensor;
}  // namespace kiln

namespace kiln::memory {
class PrivatePool;
}  // namespace kiln::memory

namespace kiln::capture {

using Replay = std::function<void()>;

/// Implemented by the compiler (export/compile): receives the events above.
class Recorder {
 public:
  virtual ~Recorder() = default;
  virtual void kernel(const char* name, Replay replay) = 0;
  virtual void host_action(const char* name, Replay replay) = 0;
  /// `what` says what could not be captured; the recorder adds where.
  virtual void graph_break(const std::string& what) = 0;
  /// A copy of `n` bytes (at most 16) kept as long as the record.
  virtual const void* keep(const void* p, int n) = 0;
  /// The autograd engine ran a backward pass inside the captured function.
  virtual void backward_ran() {}
  /// AccumulateGrad is about to accumulate into `leaf`'s .grad, which is `grad`
  /// (undefined: None). What a replay does depends on it: set .grad to the
  /// computed buffer, or add into this very tensor.
  virtual void grad_before_accumulation(const Tensor& leaf, const Tensor& grad) {
    (void)leaf;
    (void)grad;
  }
  /// A zero_grad inside the step reset `leaf`'s .grad (to None or to zeros in
  /// place): what the step accumulates into afterwards is its own doing.
  virtual void grad_reset(const Tensor& leaf) { (void)leaf; }
  /// The step used a value derived from `source`'s contents before the capture
  /// began (an autocast copy, a packed weight) without deriving it again: the
  /// record holds it as it is, so a change to `source` made outside the
  /// compiled function, or by the step itself, invalidates the record.
  virtual void reused_derivation(const char* what, const Tensor& source) {
    (void)what;
    (void)source;
  }
};

namespace detail {
extern constinit thread_local Recorder* t_recorder;
extern constinit thread_local int t_depth;  // open kernel scopes and host actions
extern constinit thread_local uint64_t t_capture_id;
}  // namespace detail

/// An id of the capture running on this thread, 0 when none: a cache of
/// derived values notes which capture made an entry, to tell a value the
/// capture derived (and recorded) from one it found ready.
inline uint64_t current_capture() noexcept { return detail::t_recorder ? detail::t_capture_id : 0; }

/// Reports a cached derived value made before this capture and used by it
/// (see Recorder::reused_derivation); nothing when no capture runs.
inline void note_reused_derivation(const char* what, const Tensor& source) {
  if (detail::t_recorder) detail::t_recorder->reused_derivation(what, source);
}

/// True while a step is being captured on this thread and no kernel or host
/// action is open: what happens now must be recorded.
inline bool recording() noexcept { return detail::t_recorder != nullptr && detail::t_depth == 0; }

/// RAII: installs `r` on this thread (null: none) and makes the private pool
/// `pool` (may be null) the source of this thread's allocations until it ends.
class RecorderGuard {
 public:
  RecorderGuard(Recorder* r, memory::PrivatePool* pool) noexcept;
  ~RecorderGuard();
  RecorderGuard(const RecorderGuard&) = delete;
  RecorderGuard& operator=(const RecorderGuard&) = delete;

 private:
  Recorder* prev_;
  int prev_depth_;
  uint64_t prev_id_;
  memory::PrivatePool* prev_pool_;
};

/// At a kernel's entry (see KILN_CAPTURE_KERNEL).
class KernelScope {
 public:
  explicit KernelScope(const char* name) noexcept : name_(name), on_(detail::t_recorder != nullptr) {
    if (on_) outer_ = detail::t_depth++ == 0;
  }
  ~KernelScope() {
    if (on_) --detail::t_depth;
  }
  KernelScope(const KernelScope&) = delete;
  KernelScope& operator=(const KernelScope&) = delete;
  bool recording() const noexcept { return on_ && outer_; }
  void record(Replay replay) const { detail::t_recorder->kernel(name_, std::move(replay)); }

 private:
  const char* name_;
  bool on_;
  bool outer_ = false;
};

/// At the top of a host-side function whose effects replay repeats by calling
/// `fn` (built only while recording). Suspends kernel recording and the
/// private pool until it ends.
class HostAction {
 public:
  template <typename F>
  HostAction(const char* name, F&& fn) : on_(detail::t_recorder != nullptr) {
    if (!on_) return;
    if (detail::t_depth == 0) detail::t_recorder->host_action(name, Replay(std::forward<F>(fn)));
    enter();
  }
  ~HostAction() {
    if (on_) leave();
  }
  HostAction(const HostAction&) = delete;
  HostAction& operator=(const HostAction&) = delete;

 private:
  void enter();
  void leave();
  bool on_;
  memory::PrivatePool* saved_pool_ = nullptr;
};

/// Runs `write` now and, while a capture records, records it for replay under
/// `name` (a literal), like a kernel: host code outside src/kernels that
/// writes tensor memory (arange's values, index_put's writes, batch norm's
/// running statistics, QAT's fake quantize, GradScaler's scale). `write`
/// captures by value what it needs and the raw data pointers of the tensors
/// it touches (a replay reuses those addresses), and is copied into the record
/// only while recording. The scope keeps kernels it calls from being recorded
/// a second time.
template <typename F>
void host_write(const char* name, F&& write) {
  const KernelScope cap(name);
  if (cap.recording()) cap.record(Replay(write));
  std::forward<F>(write)();
}

/// Records `fn` as a host action without running it, when recording: for a
/// host-side effect the caller has just made (AccumulateGrad setting .grad).
template <typename F>
void record_host(const char* name, F&& fn) {
  if (recording()) detail::t_recorder->host_action(name, Replay(std::forward<F>(fn)));
}

/// AccumulateGrad calls this, when recording, before it touches `leaf`'s .grad.
inline void note_grad_before_accumulation(const Tensor& leaf, const Tensor& grad) {
  if (recording()) detail::t_recorder->grad_before_accumulation(leaf, grad);
}

/// zero_grad calls this for each parameter it resets, while a capture runs
/// (it is a host action: kernel recording is suspended, the recorder is not).
inline void note_grad_reset(const Tensor& leaf) {
  if (detail::t_recorder) detail::t_recorder->grad_reset(leaf);
}

/// The engine calls this at the start of backward() and grad().
inline void note_backward() {
  if (detail::t_recorder) detail::t_recorder->backward_ran();
}

/// Reports a graph break when recording: `what` names the op or event
/// ("Tensor::item() reads a tensor's value on the host").
void graph_break(const char* what);
inline void graph_break_if_recording(const char* what) {
  if (recording()) graph_break(what);
}

/// While recording, a copy of the `n` bytes (at most 16) at `p` that lives as
/// long as the record; otherwise `p`. For a scalar operand that a LoopSpec
/// points at on the caller's stack (x * 0.5).
inline const void* stable_bytes(const void* p, int n) { return recording() ? detail::t_recorder->keep(p, n) : p; }

/// The bytes of a scalar argument passed by pointer (a kernel's alpha or
/// bound), copied so that a recorded closure does not point at the caller's
/// stack. ptr() is null when the original pointer was.
struct ScalarBytes {
  alignas(16) unsigned char bytes[16] = {};
  bool present = false;
  ScalarBytes() = default;
  ScalarBytes(const void* p, int nbytes);
  const void* ptr() const { return present ? bytes : nullptr; }
};

}  // namespace kiln::capture

/// Opens the kernel's capture scope; when it records, `call` (the kernel
/// called again with its own arguments) becomes the replay closure. The
/// closure copies its arguments by value: a kernel whose arguments point at
/// caller-owned arrays or scalars copies those itself (ScalarBytes).
#define KILN_CAPTURE_KERNEL(name, ...)                    \
  const ::kiln::capture::KernelScope kiln_capture_(name); \
  if (kiln_capture_.recording()) kiln_capture_.record([=] { __VA_ARGS__; })
