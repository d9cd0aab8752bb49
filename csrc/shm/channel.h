// The request channel between a worker and its k proxies: one shared-memory control segment (an
// anonymous memfd each proxy receives over its socket from the worker: shm/handoff.h).
//
//   ChannelHeader   job identity and data-plane settings (written once by the worker),
//                   `go`   futex: the worker has written the neighbours' addresses,
//                   `head` futex: number of requests posted so far (the doorbell),
//                   `stop`/`abort` flags, one LaneInfo per proxy (state, port, pid, error, stats)
//   RequestSlot[kNumSlots]  a ring of requests; slot = seq % kNumSlots
//
// The worker fills a free slot and then bumps `head` (release) and wakes the proxies. Every proxy
// takes every request in order and runs its own lane's shard; when done it bumps the slot's
// `lanes_done` (the worker waits on it as a futex). A lane that fails sets `failed`, writes the
// error code and message (first failure wins) and still bumps `lanes_done`, so the worker never waits for a
// lane that has given up. Tensor bytes never travel through this segment: a request names a data
// buffer (another shared-memory segment, handed to every proxy under its id before any request
// names it) and an offset into it.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "common/clock.h"
#include "common/status.h"
#include "transport/lane.h"
#include "transport/socket.h"

namespace fasthorovod {

constexpr uint64_t kChannelMagic = 0x46484f5643484e31ull;  // "FHOVCHN1"
constexpr uint32_t kChannelVersion = 9;
constexpr uint32_t kMaxLanes = 64;
constexpr uint32_t kMaxSocketsPerLane = 64;  // FASTHOROVOD_SOCKETS_PER_LANE's upper bound (fasthorovod/config.py)
constexpr uint32_t kNumSlots = 256;
constexpr uint32_t kMaxMeshRanks = 256;  // the alltoall's mesh (collectives/alltoall.h) up to this many ranks
constexpr size_t kErrorBytes = 2048;
constexpr size_t kHostBytes = 64;
constexpr size_t kNameBytes = 128;
constexpr size_t kTraceDirBytes = 1024;

enum class LaneState : uint32_t { kStarting = 0, kListening = 1, kConnected = 2, kFailed = 3, kExited = 4 };
// The only kind of request (a collective: an allreduce, or an allgather by its op); kept as a field
// so that a slot from a stale build is recognised as malformed.
enum class RequestKind : uint32_t { kAllreduce = 1 };

struct LaneInfo {
  std::atomic<uint32_t> state;
  int32_t pid;
  int32_t listen_port;
  int32_t alt_listen_port;            // the ring's second port (transport/socket.h, RingEndpoint)
  int32_t mesh_port;                  // the mesh's listener (0: none)
  int32_t next_port;                  // written by the worker before `go`
  int32_t next_alt_port;              // written by the worker before `go` (0: none)
  char next_host[kHostBytes];         // written by the worker before `go`
  uint32_t error_code;                // a Code: what kind of failure (state == kFailed)
  char error[kErrorBytes];            // why the lane failed (state == kFailed)
  std::atomic<int64_t> progress_ns;   // last time this lane moved a byte or finished a request
  std::atomic<uint64_t> bytes_sent;
  std::atomic<uint64_t> bytes_received;
  std::atomic<uint64_t> collectives;
  std::atomic<uint64_t> zero_filled;  // others' collectives run with zeros during the latest join
  std::atomic<uint32_t> trace_ack;    // the trace_generation this lane has applied (docs/trace.md)
  std::atomic<uint64_t> busy_ns;      // time spent inside collectives (per-lane rebalancing input)
  // The alltoall's bytes over the mesh (not in bytes_sent/busy_ns: those are the ring's, which the
  // rebalancing weighs).
  std::atomic<uint64_t> mesh_bytes_sent;
  std::atomic<uint64_t> mesh_bytes_received;
  // Re-hashing (transport/lane.h): the send sockets' pace, the sockets (bit s) the worker asks to
  // replace after the next collective (the lane takes and clears them), and how many were replaced.
  SocketCounters sockets[kMaxSocketsPerLane];
  std::atomic<uint64_t> rehash_request;
  std::atomic<uint64_t> rehashes;
  std::atomic<uint64_t> rehash_ns;  // time spent replacing connections between collectives
};

// A joined rank's contribution of zeros to a collective it did not submit (hvd.join).
constexpr uint32_t kRequestZeroFill = 1;

// One request as the worker describes it: the shared-memory slot holds exactly this, and the
// binding exposes it to Python as fasthorovod._C.Request (no argument lists to keep in step).
struct RequestDesc {
  uint32_t kind = static_cast<uint32_t>(RequestKind::kAllreduce);
  uint32_t dtype = 0;
  uint32_t op = 0;
  uint32_t buffer_id = 0;
  uint64_t seq = 0;            // set by ProxyChannel::Post
  uint64_t name_hash = 0;
  uint64_t shape_hash = 0;
  uint64_t count = 0;          // elements of the whole tensor
  uint64_t buffer_offset = 0;  // bytes into the data buffer
  double prescale = 1.0;
  double postscale = 1.0;      // including 1/size for Average
  uint32_t num_lanes = 0;      // entries used in lane_begin: num_lanes + 1
  uint32_t flags = 0;          // kRequestZeroFill
  uint64_t trace_id = ~0ull;   // the worker's ticket, for traces (kNoRequest: none)
  uint64_t lane_begin[kMaxLanes + 1] = {};  // element boundaries of the lanes' shards
  char name[kNameBytes] = {};
};

struct RequestSlot {
  std::atomic<uint32_t> lanes_done;  // futex word
  std::atomic<uint32_t> failed;
  uint32_t error_code;               // a Code, written with `error` by the first lane that failed
  uint32_t reserved;
  RequestDesc desc;
  char error[kErrorBytes];
};

struct ChannelHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t num_lanes;
  uint32_t rank;
  uint32_t size;
  uint32_t sockets_per_lane;
  int32_t socket_buffer_bytes;
  uint64_t segment_bytes;
  double timeout_seconds;
  uint64_t config_hash;
  uint8_t token[kTokenBytes];
  int32_t worker_pid;
  uint32_t reserved;
  char bind_host[kHostBytes];
  // The hierarchical allreduce (shm/host.h), written before `go`: local_size > 1 when it runs; the
  // lanes' rings then join local rank `local_rank` of the num_hosts hosts, this one being host_index.
  uint32_t local_rank;
  uint32_t local_size;
  uint32_t host_index;
  uint32_t num_hosts;
  std::atomic<uint32_t> go;
  std::atomic<uint32_t> head;
  std::atomic<uint32_t> stop;
  std::atomic<uint32_t> abort;
  uint32_t abort_code;             // a Code, written with abort_reason
  char abort_reason[kErrorBytes];  // written before `abort` is set; the root cause for every lane
  // Tracing (docs/trace.md): the worker writes trace_dir ("" = off) and the clock offset, then
  // bumps trace_generation; each lane applies it before its next request and acks it.
  char trace_dir[kTraceDirBytes];
  int64_t trace_clock_offset_ns;
  std::atomic<uint32_t> trace_generation;
  // The alltoall's mesh (collectives/alltoall.h), written before `go`: every rank's address and its
  // lanes' mesh ports; mesh_size 0 when there is none (more than kMaxMeshRanks ranks).
  uint32_t mesh_size;
  char mesh_hosts[kMaxMeshRanks][kHostBytes];
  int32_t mesh_ports[kMaxMeshRanks][kMaxLanes];
  LaneInfo lanes[kMaxLanes];
  RequestSlot slots[kNumSlots];
};

static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be lock-free");
static_assert(std::atomic<int64_t>::is_always_lock_free, "shared counters must be lock-free");

// Futex wait/wake on a 32-bit word in shared memory (cross-process). Wait returns when the word
// differs from `expected`, on a wake, or after timeout_ms (spurious returns are fine).
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int timeout_ms);
void FutexWakeAll(std::atomic<uint32_t>* word);

// Records why the job's collectives must stop (the first failure's kind and message), then raises
// the abort flag every lane polls.
void RaiseAbort(ChannelHeader* header, const Status& why);
// The same for any abort record (flag, code, reason): false when an earlier failure already holds it.
bool RecordAbort(std::atomic<uint32_t>* flag, uint32_t* code, char (&reason)[kErrorBytes], const Status& why);

// Copies a string into a fixed char array, always NUL-terminated.
template <size_t N>
void CopyString(char (&dst)[N], const std::string& src) {
  size_t n = src.size() < N - 1 ? src.size() : N - 1;
  src.copy(dst, n);
  dst[n] = '\0';
}

}  // namespace fasthorovod
