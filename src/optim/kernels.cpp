// The optimizer kernels' float and double instantiations (kernels.h declares
// them extern). CMakeLists.txt compiles this file with -fno-math-errno so the
// loops with sqrt vectorise (the kernels never read errno; GCC ignores the
// flag as a pragma/attribute).
#include "kernels.h"

namespace kiln::optim::kernels {

template void sgd<float>(float*, const float*, float*, int64_t, double, double, double, double, bool, bool);
template void sgd<double>(double*, const double*, double*, int64_t, double, double, double, double, bool, bool);
template void adam<float>(float*, const float*, float*, float*, float*, int64_t, int64_t, double, double, double,
                          double, double, bool);
template void adam<double>(double*, const double*, double*, double*, double*, int64_t, int64_t, double, double, double,
                           double, double, bool);
template void rmsprop<float>(float*, const float*, float*, float*, float*, int64_t, double, double, double, double,
                             double);
template void rmsprop<double>(double*, const double*, double*, double*, double*, int64_t, double, double, double,
                              double, double);

}  // namespace kiln::optim::kernels
