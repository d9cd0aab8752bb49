// Alltoall over the lanes' meshes: every rank sends a block to every other rank directly, over
// each lane's S sockets to that rank (transport/socket.h, EstablishMesh).
//
// A ring would forward each block through every rank between its source and its destination
// (1.5x the bytes of a direct exchange at 4 ranks, (n - 1) / 2 hops on average); the mesh sends it
// once.
//
// Lanes share every block by pulling. A block travels in segments of kMeshSegmentBytes (or
// segment_bytes where smaller); the k lanes of the sending rank claim its segments one at a time
// from a claim word they share in the size table (an atomic counter per destination), each when
// one of its sockets has nearly drained its kernel buffer (the Lane's Pulling, with the sockets'
// TCP_NOTSENT_LOWAT at one segment). A lane whose flows are faster, or that started earlier,
// carries more of the block, and the block's lanes finish within a segment's time of each other
// instead of waiting for the slowest lane's fixed part (on the emulated cloud a rank's four lanes
// finished a block up to 100 ms apart with fixed parts: docs/benchmarks.md). The receiving lane j
// takes whatever segments the sending lane j sends, each checked against this rank's own
// segmentation of the block (step = distance, segment, offset, length) before a byte of its payload
// is read, and landing in place in the receive region; each socket's end marker says how many
// frames it carried, so nothing is lost unseen. An empty block sends no frame (the end markers
// still carry the collective's descriptor, compared as every frame's is).
//
// Schedule: n - 1 steps, one per distance, run at once (up to kMaxConcurrentSteps, one thread each;
// beyond that, each thread takes the next distance when its step is done). At distance d this rank
// sends segments of the block for rank + d and receives segments of the block from rank - d, on
// the mesh links of that distance, with a Lane (LaneOptions::distance d). Lane j takes the
// distances from j % (n - 1) + 1 on, so that a rank's k lanes start with different ranks. At once,
// a pair that lags holds up no other step (one distance after another measured the same on the
// emulated cloud: docs/benchmarks.md, Tried and rejected).
//
// The block sizes come from the worker (the buffer's size table, fasthorovod/proxy/alltoall.py):
// what rank s sends to rank r is what rank r receives from rank s, because every rank computed
// its table from the same split matrix. A rank's block for itself is copied by its worker; the
// proxies never touch it.
//
// Failure. A step that fails raises the alltoall's own abort flag, with its cause: every other step
// of this rank then fails at once and sends an abort frame on its links (the Lane does), so each
// rank hears of it from the rank it waits for, whatever distance that is, and passes it on the same
// way. The job's abort flag stops the steps within 50 ms. Every wait is bounded by the lane's
// timeout.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "collectives/ring.h"
#include "common/collective.h"
#include "common/status.h"
#include "transport/socket.h"

namespace fasthorovod {

// The most steps (distances) one lane runs at once.
constexpr uint32_t kMaxConcurrentSteps = 8;

// The unit the lanes claim of a block, and each mesh socket's low water (bytes).
constexpr size_t kMeshSegmentBytes = 128 << 10;

// One rank's alltoall lies in two staging buffers. The request's buffer holds, from the request's
// offset, the size table (3n + 3 uint64: elements sent to each rank, elements received from each,
// the id of the receive buffer, the byte offset of the receive region in it, the staged word below,
// and the claim words: segments of the block for each rank the lanes have claimed, zero when the
// worker submits), then, from AlltoallSendOffset(n), the send region (blocks for ranks 0..n-1 in rank
// order). The receive region (blocks from ranks 0..n-1 in rank order) is in the receive buffer: the
// worker stages its rows while the split matrix is still being gathered, before it knows how much
// it will receive.
//
// Staging overlaps the mesh. The worker copies its blocks into the send region in distance order
// (the block for rank + 1 first) and publishes, in the staged word (a release store), how many it
// has copied; it submits the alltoall as soon as the split matrix is in, whether or not staging is
// done. The step of distance d sends once the staged word reaches d (it receives meanwhile), so
// the first blocks travel while the last are copied. kAlltoallStagingFailed there: the worker
// could not stage its rows, and the alltoall fails on every rank.
size_t AlltoallTableWords(uint32_t n);
size_t AlltoallSendOffset(uint32_t n);  // the table's bytes, rounded up to 64
size_t AlltoallStagedWord(uint32_t n);  // the staged word's index in the table
size_t AlltoallClaimWord(uint32_t n);   // the index of the first claim word (n of them, by rank)
constexpr uint64_t kAlltoallStagingFailed = ~uint64_t{0};

// One lane's alltoall.
struct AlltoallWork {
  const char* send = nullptr;  // the send region
  char* recv = nullptr;        // the receive region
  std::vector<uint64_t> send_count;  // elements for each rank
  std::vector<uint64_t> recv_count;  // elements from each rank
  DType dtype = DType::kFloat32;
  uint32_t lanes = 1;  // the rank's lanes, and this one
  uint32_t lane = 0;
  // The claim words the rank's lanes share (one per destination rank, zero at the start; atomic
  // read-modify-writes from several processes).
  uint64_t* claimed = nullptr;
  // The table's staged word (read with acquire loads while the worker writes it), or null when
  // every block is in the send region already.
  const uint64_t* staged = nullptr;
};

// Runs the alltoall with `by_distance` (EstablishMesh's links: entry d sends to rank + d).
// `options` gives the rank, size, lane, timeout, abort flag and observer; the neighbour names are
// made per step. A step waits for its block to be staged at most the lane's timeout. On failure the
// mesh is unusable.
Status MeshAlltoall(std::vector<RingLinks>& by_distance, const CollectiveDesc& desc, const AlltoallWork& work,
                    const RingOptions& options, RingStats* stats);

}  // namespace fasthorovod
