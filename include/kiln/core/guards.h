// Thread-local modes that ops consult, behind RAII guards (DESIGN.md §2).
// Grad mode and inference mode live in core because every op reads them;
// the autograd layer re-exports the guards and adds anomaly mode.
#pragma once

namespace kiln {

bool grad_mode_enabled();
void set_grad_mode_enabled(bool enabled);
bool inference_mode_enabled();

/// torch.no_grad(): ops record no graph while alive.
class NoGradGuard {
 public:
  NoGradGuard() : prev_(grad_mode_enabled()) { set_grad_mode_enabled(false); }
  ~NoGradGuard() { set_grad_mode_enabled(prev_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

/// torch.enable_grad(): re-enables recording inside a no-grad region.
class EnableGradGuard {
 public:
  EnableGradGuard() : prev_(grad_mode_enabled()) { set_grad_mode_enabled(true); }
  ~EnableGradGuard() { set_grad_mode_enabled(prev_); }
  EnableGradGuard(const EnableGradGuard&) = delete;
  EnableGradGuard& operator=(const EnableGradGuard&) = delete;

 private:
  bool prev_;
};

/// torch.inference_mode(): no graph, and tensors made here are marked as
/// inference tensors that autograd refuses to save later.
class InferenceModeGuard {
 public:
  InferenceModeGuard();
  ~InferenceModeGuard();
  InferenceModeGuard(const InferenceModeGuard&) = delete;
  InferenceModeGuard& operator=(const InferenceModeGuard&) = delete;

 private:
  bool prev_grad_;
  bool prev_inference_;
};

}  // namespace kiln
