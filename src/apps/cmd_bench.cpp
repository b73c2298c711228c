#include "apps/commands.h"
#include "core/error.h"

namespace kda::apps {

int cmd_bench(const Args&) {
  throw Error("bench: not written yet");
}

}  // namespace kda::apps
