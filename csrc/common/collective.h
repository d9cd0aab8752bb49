// One collective, as every rank of a lane must see it.
//
// A CollectiveDesc is what ranks agree on for one collective of one lane. The proxy fills it from
// its request, the lane transport carries it inside every frame header (transport/lane.h), and the
// receiver compares the sender's with its own: SameCollective is the one definition of "the same
// collective", DescribeCollective the one way to name it in a message. A difference means the
// ranks issued different collectives (order, size, dtype, op, shape).
#pragma once

#include <cstdint>
#include <string>

#include "common/dtype.h"

namespace fasthorovod {

constexpr size_t kWireNameBytes = 32;

// kGather is not a reduction: the collective is an allgather (see RingAllreduce).
// kReduceScatter is a sum that stops after the ring's reduce-scatter phase: each rank keeps the
// chunk it holds reduced (see RingAllreduce). The worker lays each rank's part out as an
// allgather's rows (fasthorovod/proxy/scatter.py).
// kAlltoall is not a reduction either: each rank sends a block to every other rank over the
// proxies' mesh (collectives/alltoall.h); the request's buffer holds the block sizes.
// kBroadcast is reduced as kSum of integer words: the worker stages the root's tensor on the root and
// zeros everywhere else (fasthorovod/proxy/group.py, ProxyGroup.broadcast), so every rank receives the
// root's bytes. It has its own code so that a broadcast and an allreduce of one name never match, and
// so that the negotiation can refuse it while a rank has joined (a joined rank's zeros could stand in
// for the root's tensor), as Horovod does.
enum class ReduceOp : uint32_t { kSum = 0, kAverage = 1, kGather = 2, kBroadcast = 3, kReduceScatter = 4,
                              kAlltoall = 5 };

// Whether a collective of `op` holds `size` equal rows, one per rank, each laid out by equal shares
// of its width over the lanes (an allgather, a reduce-scatter); other collectives are cut by the
// lane weights.
inline bool RowsPerRank(uint32_t op) {
  return op == static_cast<uint32_t>(ReduceOp::kGather) || op == static_cast<uint32_t>(ReduceOp::kReduceScatter);
}

// Plain data, embedded in the wire header: the layout is fixed (88 bytes, static_assert below).
struct CollectiveDesc {
  uint64_t seq = 0;           // per-lane collective counter
  uint64_t name_hash = 0;     // hash of the tensor name
  uint64_t shape_hash = 0;    // hash of the tensor shape
  uint64_t total_bytes = 0;   // bytes of the whole tensor
  uint64_t shard_bytes = 0;   // bytes of this lane's shard
  uint16_t dtype = 0;         // DType
  uint16_t op = 0;            // ReduceOp
  double postscale = 1.0;     // (compared by the negotiation; carried for traces and messages)
  char name[kWireNameBytes] = {};  // tensor name, truncated, for error messages
};
static_assert(sizeof(CollectiveDesc) == 88, "CollectiveDesc is embedded in the wire frame header");

// True when a and b describe the same collective: every field but the postscale and the name
// (which only serve a joined rank and messages).
bool SameCollective(const CollectiveDesc& a, const CollectiveDesc& b);

// "tensor 'w' (collective #3, 4096 bytes, lane shard 1024 bytes, float32, sum)".
std::string DescribeCollective(const CollectiveDesc& d);

// The message of a mismatch between `mine` (this rank's) and `theirs` (received from prev_rank).
std::string MismatchMessage(uint32_t lane, uint32_t rank, const CollectiveDesc& mine, uint32_t prev_rank,
                            const CollectiveDesc& theirs);

}  // namespace fasthorovod
