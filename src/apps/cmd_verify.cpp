#include "apps/commands.h"
#include "core/error.h"

namespace kda::apps {

int cmd_verify(const Args&) {
  throw Error("verify: not written yet");
}

}  // namespace kda::apps
