// The proxy process's main loop (one process per lane per worker).
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"

namespace fasthorovod {

// Maps the worker's channel, listens, waits for the neighbours' addresses, connects the lane's
// ring, then serves requests until the worker says stop, the worker dies, or the lane fails.
// Returns OK on an orderly stop; failures are also written into the channel for the worker.
Status RunProxy(const std::string& channel_name, uint32_t lane);

}  // namespace fasthorovod
