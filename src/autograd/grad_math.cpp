#include "kiln/autograd/grad_math.h"

#include "kiln/core/error.h"

namespace kiln::autograd {

namespace {
// Constant-initialised (no constructor runs), so ops' static initialiser may
// install the table before or after this file's own initialisation.
const GradMath* g_math = nullptr;
}  // namespace

const GradMath& grad_math() {
  KILN_CHECK(g_math != nullptr, InternalError,
             "autograd: the ops layer did not install its tensor arithmetic (kiln_ops is not linked, or was linked "
             "without its interface link options)");
  return *g_math;
}

void install_grad_math(const GradMath& math) { g_math = &math; }

}  // namespace kiln::autograd
