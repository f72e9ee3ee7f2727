// The optimizer kernels' float and double instantiations. CMakeLists.txt
// compiles this file with -fno-math-errno so the loops with sqrt vectorise
// (the kernels never read errno; GCC ignores the flag as a pragma/attribute).
#define KILN_OPTIM_KERNELS_INSTANTIATE
#include "kernels.h"
