// Where each recorded kernel came from, for kiln::compile's per-event profile
// (CompileStats::replay_events, docs/compile.md "Profiling a replay").
//
// A kernel knows its own name ("binary"), not the op that ran it nor the
// user's line. Public ops open an ops::OpScope at entry; while a compile
// capture listens on this thread the scope reports entering and leaving here,
// so the recorder can charge the kernels in between to the outermost op. An
// op notes its caller's line (memory::note_call_site) when it records its
// autograd node, which is after its kernels ran; the count of notes says
// whether the op noted one at all, so that a line is only ever reported for
// the op that noted it.
//
// Kept apart from capture.h so that only the ops' scope and the compiler see it.
#pragma once

#include <cstdint>
#include <string_view>

namespace kiln::capture {

/// Implemented by the compiler's recorder.
class OpSink {
 public:
  virtual ~OpSink() = default;
  virtual void op_enter(std::string_view name) = 0;
  virtual void op_exit() = 0;
};

namespace detail {
extern constinit thread_local OpSink* t_op_sink;
}  // namespace detail

/// How many times this thread's user call site changed hands
/// (memory::note_call_site took a site): compare two readings to learn
/// whether anything noted a line in between.
uint64_t site_notes();

/// RAII: installs `sink` on this thread for the duration of a capture.
class OpSinkGuard {
 public:
  explicit OpSinkGuard(OpSink* sink) noexcept : prev_(detail::t_op_sink) { detail::t_op_sink = sink; }
  ~OpSinkGuard() { detail::t_op_sink = prev_; }
  OpSinkGuard(const OpSinkGuard&) = delete;
  OpSinkGuard& operator=(const OpSinkGuard&) = delete;

 private:
  OpSink* prev_;
};

}  // namespace kiln::capture
