// Registry entries for the conv_pool family (filled in below).
#include "kiln/ops/op_spec.h"

namespace kiln::ops {

void register_conv_pool_ops(std::vector<OpSpec>& r) { (void)r; }

}  // namespace kiln::ops
