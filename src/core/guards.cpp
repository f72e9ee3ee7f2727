#include "kiln/core/guards.h"

namespace kiln {

namespace {
thread_local bool t_grad_enabled = true;
thread_local bool t_inference = false;
}  // namespace

bool grad_mode_enabled() { return t_grad_enabled; }
void set_grad_mode_enabled(bool enabled) { t_grad_enabled = enabled; }
bool inference_mode_enabled() { return t_inference; }

InferenceModeGuard::InferenceModeGuard() : prev_grad_(t_grad_enabled), prev_inference_(t_inference) {
  t_grad_enabled = false;
  t_inference = true;
}
InferenceModeGuard::~InferenceModeGuard() {
  t_grad_enabled = prev_grad_;
  t_inference = prev_inference_;
}

}  // namespace kiln
