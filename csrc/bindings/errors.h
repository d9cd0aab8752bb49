// The binding edge of the one error path: a failed Status becomes one exception of the
// fasthorovod.exceptions family (shared by fasthorovod._C and fasthorovod._C_testing).
#pragma once

#include "common/status.h"

namespace fasthorovod {

[[noreturn]] void Raise(const Status& st);

inline void Check(const Status& st) {
  if (!st.ok()) Raise(st);
}

}  // namespace fasthorovod
