#include "core/parallel.h"

#include <omp.h>

namespace kda {

int hardware_threads() {
  return omp_get_max_threads();
}

}  // namespace kda
