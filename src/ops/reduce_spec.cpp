// Registry entries for the reduction family (include/kiln/ops/op_spec.h).
#include "kiln/ops/op_spec.h"

namespace kiln::ops {

void register_reduction_ops(std::vector<OpSpec>& r) { (void)r; }

}  // namespace kiln::ops
