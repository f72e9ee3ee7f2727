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
// A recorder may instead *defer* (Recorder::defers): kiln::compile running a
// function whose record has graph breaks runs it again on every call, and
// the kernels that can wait (those whose scope is kDeferrable: elementwise
// loops, reductions, products, host writes, every KILN_CAPTURE_KERNEL one)
// are handed over and not run; they run,
// fused, when something needs their results on the host — a graph break, a
// host action, a kernel that cannot wait (KernelScope without kDeferrable
// syncs first), an explicit sync() — or when the function returns. That is
// how a function is split at its graph breaks (docs/compile.md).
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
class StorageImpl;
}  // namespace kiln

namespace kiln::memory {
class PrivatePool;
}  // namespace kiln::memory

namespace kiln::capture {

using Replay = std::function<void()>;

/// Implemented by the compiler (export/compile): receives the events above.
class Recorder {
 public:
  explicit Recorder(bool defers = false) : defers(defers) {}
  virtual ~Recorder() = default;
  /// kernel() receives kernels to run later, not records of kernels that ran.
  const bool defers;
  /// A deferring recorder runs what it holds: host code is about to read or
  /// write tensor memory, or run a kernel that cannot wait. `before` names
  /// what comes next (a kernel's or host action's name, or a phrase).
  virtual void sync(const char* before) { (void)before; }
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
  /// A storage was watched (see watch()): `id` now names it, its bytes start at `data`.
  virtual void watched(uint32_t id, const void* data, const char* role) {
    (void)id;
    (void)data;
    (void)role;
  }
  /// Host code took the address of a watched storage's bytes: the op that
  /// did is about to record its kernels, or is recording them.
  virtual void watched_access(uint32_t id) { (void)id; }
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

/// Runs what a deferring recorder holds (see Recorder::defers): before host
/// code reads tensor values that the step may have computed (an index check).
/// `before` says what reads them ("an index check"), for explain().
inline void sync(const char* before = "a read of tensor values on the host") {
  if (detail::t_recorder && detail::t_depth == 0 && detail::t_recorder->defers) detail::t_recorder->sync(before);
}

/// RAII: kernels called while it lives run at once and are not recorded (a
/// deferring recorder runs what it holds under it).
class RunNow {
 public:
  RunNow() noexcept { ++detail::t_depth; }
  ~RunNow() { --detail::t_depth; }
  RunNow(const RunNow&) = delete;
  RunNow& operator=(const RunNow&) = delete;
};

/// Marks a kernel that a deferring recorder may hold and run later: it
/// touches memory only through its arguments and returns nothing the caller
/// reads, and it returns right after record() when record() says so.
struct Deferrable {};
inline constexpr Deferrable kDeferrable{};

/// At a kernel's entry (see KILN_CAPTURE_KERNEL).
class KernelScope {
 public:
  // A kernel that cannot wait runs now, after what a deferring recorder holds.
  // Its nested kernels run inside it, as in a capture.
  explicit KernelScope(const char* name) : name_(name), on_(detail::t_recorder != nullptr) {
    if (!on_) return;
    if (detail::t_depth == 0 && detail::t_recorder->defers) {
      detail::t_recorder->sync(name);
      now_ = true;  // nothing to record: this call is not replayed
    }
    outer_ = detail::t_depth++ == 0;
  }
  KernelScope(const char* name, Deferrable) noexcept : name_(name), on_(detail::t_recorder != nullptr) {
    if (on_) outer_ = detail::t_depth++ == 0;
  }
  ~KernelScope() {
    if (on_) --detail::t_depth;
  }
  KernelScope(const KernelScope&) = delete;
  KernelScope& operator=(const KernelScope&) = delete;
  bool recording() const noexcept { return on_ && outer_ && !now_; }
  /// True when the recorder deferred the kernel: the caller returns without running it.
  bool record(Replay replay) const {
    detail::t_recorder->kernel(name_, std::move(replay));
    return detail::t_recorder->defers;
  }

 private:
  const char* name_;
  bool on_;
  bool outer_ = false;
  bool now_ = false;
};

/// At the top of a host-side function whose effects replay repeats by calling
/// `fn` (built only while recording). Suspends kernel recording and the
/// private pool until it ends.
class HostAction {
 public:
  template <typename F>
  HostAction(const char* name, F&& fn) : on_(detail::t_recorder != nullptr) {
    if (!on_) return;
    // A deferring recorder runs what it holds first: the action reads and writes tensors now.
    if (detail::t_depth == 0) {
      if (detail::t_recorder->defers)
        detail::t_recorder->sync(name);
      else
        detail::t_recorder->host_action(name, Replay(std::forward<F>(fn)));
    }
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
  const KernelScope cap(name, kDeferrable);
  if (cap.recording() && cap.record(Replay(write))) return;
  std::forward<F>(write)();
}

/// Records `fn` as a host action without running it, when recording: for a
/// host-side effect the caller has just made (AccumulateGrad setting .grad).
/// A deferring recorder needs nothing: the effect is made on every call.
template <typename F>
void record_host(const char* name, F&& fn) {
  if (recording() && !detail::t_recorder->defers) detail::t_recorder->host_action(name, Replay(std::forward<F>(fn)));
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

/// While recording, watches `s` for kiln::compile's graph rewrites
/// (docs/compile.md, "Rewrites"): from now on the recorder hears of every op
/// that takes the address of its bytes, whichever tensor or view it goes
/// through. `role` says what the storage is ("relu output"). An op that
/// makes a tensor a rewrite may replace calls this on its output; a rewrite
/// applies only when the accesses show that no other op reads the bytes.
void watch(StorageImpl& s, const char* role);
/// How many times, since the process began, an op took the address of a
/// watched storage's bytes on a thread with no capture recording (an OpenMP
/// worker, say): a capture that sees this change while it runs cannot tell
/// who read what, and applies no rewrite.
uint64_t unattributed_watched_accesses() noexcept;

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
/// caller-owned arrays or scalars copies those itself (ScalarBytes). The
/// kernel returns void and may be deferred (kDeferrable): when the recorder
/// defers, the macro returns from it.
#define KILN_CAPTURE_KERNEL(name, ...)                                                  \
  const ::kiln::capture::KernelScope kiln_capture_(name, ::kiln::capture::kDeferrable); \
  if (kiln_capture_.recording() && kiln_capture_.record([=] { __VA_ARGS__; })) return

/// KILN_CAPTURE_KERNEL for a kernel whose result the caller reads: it always
/// runs when called, after what a deferring recorder holds.
#define KILN_CAPTURE_KERNEL_NOW(name, ...)                \
  const ::kiln::capture::KernelScope kiln_capture_(name); \
  if (kiln_capture_.recording()) (void)kiln_capture_.record([=] { __VA_ARGS__; })
