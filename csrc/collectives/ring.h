// Ring allreduce of one lane's shard, over the sockets of that lane's ring.
#pragma once

#include <cstddef>
#include <cstdint>

#include "collectives/reduce.h"
#include "common/collective.h"
#include "common/status.h"
#include "transport/lane.h"
#include "transport/socket.h"

namespace fasthorovod {

// The shard is one local rank's part of data that several ranks of a host hold (the hierarchical
// allreduce, shm/host.h): the ring asks for the host's other contributions to a range just before
// it first reads the range, and hands every range on as soon as it holds the result, so that the
// shared-memory work overlaps the network's. Ranges are elements of the shard.
class HostShare {
 public:
  virtual ~HostShare() = default;
  // Adds the host's other contributions into [begin, begin + count) of the shard: called once per
  // element, before the ring sends or adds into it.
  virtual void ReduceIn(size_t begin, size_t count) = 0;
  // [begin, begin + count) holds the final result: called once per element, after its ReduceIn.
  virtual void CopyOut(size_t begin, size_t count) = 0;
};

// The shard to reduce, in place.
struct ShardWork {
  void* data = nullptr;
  size_t count = 0;  // elements
  DType dtype = DType::kFloat32;
  double prescale = 1.0;   // applied to the local input once
  double postscale = 1.0;  // applied to every reduced element once (includes 1/size for Average)
  HostShare* host = nullptr;  // the host's other local ranks (a sum; prescale 1: each owner prescales its own)
};

// The lane's options (ranks, timeout, abort flag, observer, neighbour names) and the segment size.
struct RingOptions : LaneOptions {
  size_t segment_bytes = 1 << 20;
};

// Per-call measurements, cheap enough to take on every collective (for lane rebalancing/traces).
struct RingStats : LaneStats {
  int64_t start_ns = 0;
  int64_t end_ns = 0;
};

// Runs reduce-scatter then allgather of `work` with the neighbours on `links` (desc.op kGather:
// the allgather only, with this rank's contribution in chunk AllgatherOwnChunk(rank, size) of the
// shard and nothing reduced or scaled; kReduceScatter: the reduce-scatter only, after which chunk
// AllgatherOwnChunk(rank, size) is this rank's, reduced and postscaled; chunk c is [c·count/size, (c+1)·count/size)). On failure the
// lane is unusable; the returned Status says why, and every rank of the ring fails with the same
// code and explanation (the lane transport forwards an abort frame, transport/lane.h).
Status RingAllreduce(RingLinks& links, const CollectiveDesc& desc, const ShardWork& work,
                     const RingOptions& options, RingStats* stats);

// What a ring of one rank does to a sum's shard after its prescale: the host's other contributions
// added in (work.host), the postscale applied and the result copied out to the host, block by block
// of `block_bytes` (a block is still in cache when it is scaled and copied out). The hierarchical
// allreduce on a single host runs this instead of a ring. A compressed dtype's results are rounded
// to its wire type, as a ring's are (every rank gets the same kind of values, whatever the layout).
void ReduceWithoutRing(const ShardWork& work, size_t block_bytes);

// A chunk is cut into at least one segment per socket, but not below this (frames of less would
// cost more in headers and wake-ups than an idle socket loses).
constexpr size_t kMinRingSegmentBytes = 64 << 10;

// Helpers exposed for unit tests: chunk boundaries and segment counts of the ring schedule.
size_t ChunkBegin(size_t count, uint32_t size, uint32_t chunk);
// Elements per segment for `count` elements of `elem` bytes over a ring of `size` ranks whose
// lane has `sockets` sockets: segment_bytes, or less so that the largest chunk has a segment for
// every socket (not below kMinRingSegmentBytes).
size_t RingSegmentElements(size_t count, uint32_t size, size_t sockets, size_t segment_bytes, size_t elem);
size_t SegmentCount(size_t chunk_elements, size_t segment_elements);
// The chunk a rank holds complete when the allgather phase starts (its contribution to a kGather,
// its result of a kReduceScatter).
uint32_t AllgatherOwnChunk(uint32_t rank, uint32_t size);

}  // namespace fasthorovod
