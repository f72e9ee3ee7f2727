// Registry entries for the linalg family (filled in below).
#include "kiln/ops/op_spec.h"

namespace kiln::ops {

void register_linalg_ops(std::vector<OpSpec>& r) { (void)r; }

}  // namespace kiln::ops
