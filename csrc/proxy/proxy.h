// The proxy process's main loop (one process per lane per worker).
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"

namespace fasthorovod {

// Receives the worker's channel on `segments` (its end of the lane's socket pair, shm/handoff.h)
// and maps it, listens, waits for the neighbours' addresses, connects the lane's ring, then serves
// requests until the worker says stop, the worker process dies, or the lane fails. Returns OK on
// an orderly stop; failures are also written into the channel for the worker.
Status RunProxy(int segments, uint32_t lane);

}  // namespace fasthorovod
