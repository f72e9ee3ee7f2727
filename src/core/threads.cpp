#include "kiln/core/threads.h"

#include <omp.h>

#include <cstdlib>

#include "kiln/core/error.h"

namespace kiln {

int get_num_threads() { return omp_get_max_threads(); }

void set_num_threads(int n) {
  KILN_CHECK(n >= 1, ValueError, "set_num_threads: expected a thread count >= 1, got ", n);
  omp_set_num_threads(n);
}

}  // namespace kiln
