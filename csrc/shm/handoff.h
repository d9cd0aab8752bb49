// Handing shared-memory segments from a worker to one of its proxies: the segment's memfd travels
// over a Unix socket pair (SOCK_SEQPACKET, one message per segment, the descriptor as SCM_RIGHTS),
// so segments need no names and no token material ever appears in a file system.
//
// The worker creates one socket pair per proxy before spawning it; the proxy inherits its end
// (python -m fasthorovod.proxy FD LANE). The first message is the channel (kChannelSegment); every
// data buffer follows as soon as the worker creates it, before any request names it, so a proxy
// that meets an unknown buffer id only has to read its socket to find it. Descriptors still in a
// socket when a process dies are dropped by the kernel with the socket: nothing to clean up.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/clock.h"
#include "common/status.h"

namespace fasthorovod {

constexpr uint32_t kChannelSegment = 0xffffffffu;  // the id under which the channel itself is sent

struct SegmentGrant {
  uint32_t id = 0;     // a data buffer id, or kChannelSegment
  uint64_t bytes = 0;  // the segment's size
  int fd = -1;         // the received memfd (the caller owns it)
};

// Sends (id, bytes, fd) on `sock` (fd is duplicated by the kernel; the caller keeps its own),
// waiting up to the deadline while the socket is full. A proxy that is gone (EPIPE, ECONNRESET)
// is not an error here: its death is reported by the worker's watch on it.
Status SendSegment(int sock, uint32_t id, uint64_t bytes, int fd, Deadline deadline);

// Receives the next grant, waiting up to timeout_ms (0: only what is already queued). Returns Ok
// with grant->fd == -1 when nothing arrived in time; kAborted when the worker's end is closed.
Status ReceiveSegment(int sock, int timeout_ms, SegmentGrant* grant);

}  // namespace fasthorovod
