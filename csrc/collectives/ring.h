// Ring allreduce of one lane's shard, over the sockets of that lane's ring.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "collectives/reduce.h"
#include "common/status.h"
#include "trace/recorder.h"
#include "transport/socket.h"

namespace fasthorovod {

constexpr uint32_t kFrameMagic = 0x46485652u;  // "FHVR"
constexpr size_t kWireNameBytes = 32;

// kGather is not a reduction: the collective is an allgather (see RingAllreduce).
enum class ReduceOp : uint32_t { kSum = 0, kAverage = 1, kGather = 2 };

// What every rank must agree on for one collective. Carried in every frame header and compared
// by the receiver against its own: a difference is an ordering or shape mismatch between ranks.
struct CollectiveDesc {
  uint64_t seq = 0;           // per-lane collective counter
  uint64_t name_hash = 0;     // hash of the tensor name
  uint64_t shape_hash = 0;    // hash of the tensor shape
  uint64_t total_bytes = 0;   // bytes of the whole tensor
  uint64_t shard_bytes = 0;   // bytes of this lane's shard
  uint32_t dtype = 0;
  uint32_t op = 0;
  uint32_t epoch = 0;         // joins completed so far (see hvd.join in proxy.cc)
  double postscale = 1.0;     // carried so that a joined rank can take part without a request
  char name[kWireNameBytes] = {};  // tensor name, truncated, for error messages
};

// The shard to reduce, in place.
struct ShardWork {
  void* data = nullptr;
  size_t count = 0;  // elements
  DType dtype = DType::kFloat32;
  double prescale = 1.0;   // applied to the local input once
  double postscale = 1.0;  // applied to every reduced element once (includes 1/size for Average)
};

struct RingOptions {
  uint32_t rank = 0;
  uint32_t size = 1;
  uint32_t lane = 0;
  size_t segment_bytes = 1 << 20;
  double timeout_seconds = 300.0;             // longest time without any byte moving
  const std::atomic<uint32_t>* abort = nullptr;  // polled; non-zero makes the collective fail
  const char* abort_reason = nullptr;             // why, once `abort` is set (may be null)
  std::atomic<int64_t>* progress_ns = nullptr;    // if set, stamped whenever bytes move
  TraceRecorder* trace = nullptr;          // if set, one record per frame (docs/trace.md)
  uint64_t trace_request = kNoRequest;     // the worker's request number, for the records
  uint8_t trace_flags = 0;                 // kTraceFlag*
  std::string prev_name;  // "rank 0 (10.0.0.1:4242)" for messages
  std::string next_name;
};

// Per-call measurements, cheap enough to take on every collective (for lane rebalancing/traces).
struct RingStats {
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t frames_sent = 0;
  uint64_t frames_received = 0;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
};

// Runs reduce-scatter then allgather of `work` with the neighbours on `links` (desc.op kGather:
// the allgather only, with this rank's contribution in chunk AllgatherOwnChunk(rank, size) of the
// shard and nothing reduced or scaled; chunk c is [c·count/size, (c+1)·count/size)). On failure the
// lane is unusable; the returned Status says why. When this rank detected the failure (or
// received an abort from its previous rank), it sends an abort frame with the message to the next
// rank so that every rank of the ring fails with the same explanation instead of a bare EOF.
Status RingAllreduce(RingLinks& links, const CollectiveDesc& desc, const ShardWork& work,
                     const RingOptions& options, RingStats* stats);

// For a rank that has joined (hvd.join) and has no request of its own: waits up to timeout_ms for
// the previous rank to start a collective and describes it from its first frame header (peeked,
// not consumed). *started stays false when nothing arrived. An abort frame becomes an error.
Status PeekCollective(RingLinks& links, const RingOptions& options, int timeout_ms, bool* started,
                      CollectiveDesc* desc);

// Helpers exposed for unit tests: chunk boundaries and segment counts of the ring schedule.
size_t ChunkBegin(size_t count, uint32_t size, uint32_t chunk);
size_t SegmentCount(size_t chunk_elements, size_t segment_elements);
// The chunk a rank holds complete when the allgather phase starts (its contribution to a kGather).
uint32_t AllgatherOwnChunk(uint32_t rank, uint32_t size);

}  // namespace fasthorovod
