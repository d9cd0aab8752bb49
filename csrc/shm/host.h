// The host segment: what the L workers of one host (and their proxies) share for the
// hierarchical allreduce (docs/hierarchical.md).
//
// With L > 1 ranks on a host, lane j's shard of a large allreduce runs in three phases among the
// L proxies j of the host (one per local rank), each of which owns 1/L of the shard ("its part"):
//
//   1. reduce-scatter in shared memory: proxy (l, j) adds part l of every local rank's data buffer
//      into its own worker's buffer, reading the other workers' buffers in place;
//   2. across hosts: proxy (l, j) runs the ring allreduce of its part with proxy (l, j) of every
//      other host (H steps instead of H·L, and the NIC carries L·k·S flows);
//   3. allgather in shared memory: proxy (l, j) writes its part's result into every other local
//      rank's buffer.
// Only proxy (l, j) touches part l of any buffer, so the phases need no meeting in between: they
// run segment by segment inside the ring (collectives/ring.h, HostShare), a segment reduced in the
// host just before the ring first uses it and copied out as soon as it is final.
//
// The proxies of a lane meet at two counters per local rank (posted, copied: the number of
// hierarchical collectives this lane has reached that point of), futex words in this segment;
// requests arrive in the negotiated order, the same on every rank, so the counters of the L
// proxies name the same collective. Every wait is bounded by the timeout, polls the abort flags
// every 100 ms and checks that the other proxies it waits for are alive.
//
// The segment is an anonymous memfd created by local rank 0's worker; the other local workers open
// it through /proc/<pid>/fd/<fd> (same host, same user: ptrace read access), check that it belongs
// to the same job (the token), and hand it to their proxies like any segment. Data buffers are shared
// the same way: a worker keeps each buffer's descriptor open and lists (id, fd, bytes) in its table
// here; a proxy of another local rank opens /proc/<worker pid>/fd/<fd> the first time a request
// names the buffer and keeps the mapping. Nothing has a name, so nothing can be left behind.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "common/status.h"
#include "shm/channel.h"
#include "shm/segment.h"

namespace fasthorovod {

constexpr uint64_t kHostMagic = 0x46484f56484f5331ull;  // "FHOVHOS1"
constexpr uint32_t kHostVersion = 2;  // bump with any change of the layout below
constexpr uint32_t kMaxLocalRanks = 16;
constexpr uint32_t kMaxHostBuffers = 1024;  // per local rank: data buffers a worker may share
constexpr uint32_t kHostSegment = 0xfffffffeu;  // the id under which the host segment is handed to a proxy

// What the proxy of one local rank posted for the lane's current hierarchical collective.
struct HostPost {
  std::atomic<uint32_t> posted;   // futex: collectives whose data (prescaled) is in place
  std::atomic<uint32_t> copied;   // futex: ... whose own part's result is in every local buffer
  int32_t proxy_pid;
  uint32_t buffer_id;
  uint32_t dtype;
  uint32_t op;
  uint32_t reserved;
  uint64_t buffer_offset;
  uint64_t count;       // elements of the whole tensor
  uint64_t lane_begin;  // this lane's shard, elements
  uint64_t lane_end;
  uint64_t name_hash;
};

struct HostBufferEntry {
  uint32_t id;
  int32_t fd;  // in the worker's process
  uint64_t bytes;
};

struct HostHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t local_size;
  uint8_t token[kTokenBytes];
  int32_t worker_pid[kMaxLocalRanks];
  std::atomic<uint32_t> abort;
  uint32_t abort_code;
  uint32_t abort_rank;  // the rank whose proxy raised it
  char abort_reason[kErrorBytes];
  std::atomic<uint32_t> num_buffers[kMaxLocalRanks];
  HostBufferEntry buffers[kMaxLocalRanks][kMaxHostBuffers];
  HostPost posts[kMaxLanes][kMaxLocalRanks];
};

// One worker's (or proxy's) mapping of the host segment.
class HostSegment {
 public:
  // Local rank 0's worker: a new segment for `local_size` ranks of the job holding `token`.
  static Status Create(uint32_t local_size, const std::string& token, HostSegment* out);
  // Another local worker: opens local rank 0's segment through /proc/<pid>/fd/<fd> and checks it.
  static Status Open(int pid, int fd, uint32_t local_size, const std::string& token, HostSegment* out);
  // A proxy: maps the descriptor its worker handed over (takes ownership of fd).
  static Status Map(int fd, uint64_t bytes, HostSegment* out);

  HostHeader* header() const { return static_cast<HostHeader*>(segment_.data()); }
  int fd() const { return segment_.fd(); }
  bool attached() const { return segment_.data() != nullptr; }

  // Lists a data buffer of `local_rank`'s worker (this process: its fd stays open) for the others.
  Status Publish(uint32_t local_rank, uint32_t id, int fd, uint64_t bytes);
  // Maps buffer `id` of `local_rank`'s worker (read and write).
  Status MapBuffer(uint32_t local_rank, uint32_t id, ShmSegment* out) const;

 private:
  ShmSegment segment_;
};

// Records the first failure on this host and raises its abort flag (every waiting proxy of every
// lane wakes within 100 ms, or at once for the lane named).
void RaiseHostAbort(HostHeader* host, uint32_t rank, const Status& why);

}  // namespace fasthorovod
