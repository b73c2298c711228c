#include "apps/commands.h"
#include "core/error.h"

namespace kda::apps {

int cmd_lineage(const Args&) {
  throw Error("lineage: not written yet");
}

}  // namespace kda::apps
