#include "common/collective.h"

#include <cstring>

#include "common/status.h"

namespace fasthorovod {

bool SameCollective(const CollectiveDesc& a, const CollectiveDesc& b) {
  return a.seq == b.seq && a.name_hash == b.name_hash && a.shape_hash == b.shape_hash &&
         a.total_bytes == b.total_bytes && a.shard_bytes == b.shard_bytes && a.dtype == b.dtype && a.op == b.op;
}

std::string DescribeCollective(const CollectiveDesc& d) {
  std::string name(d.name, strnlen(d.name, kWireNameBytes));
  const std::string kind = d.op == static_cast<uint32_t>(ReduceOp::kSum)         ? std::string("sum")
                          : d.op == static_cast<uint32_t>(ReduceOp::kAverage)   ? std::string("average")
                          : d.op == static_cast<uint32_t>(ReduceOp::kGather)    ? std::string("allgather")
                          : d.op == static_cast<uint32_t>(ReduceOp::kBroadcast) ? std::string("broadcast")
                          : d.op == static_cast<uint32_t>(ReduceOp::kReduceScatter) ? std::string("reducescatter")
                          : d.op == static_cast<uint32_t>(ReduceOp::kAlltoall)  ? std::string("alltoall")
                                                                                : Str("op code ", d.op);
  return Str("tensor '", name, "' (collective #", d.seq, ", ", d.total_bytes, " bytes, lane shard ", d.shard_bytes,
             " bytes, ", DTypeValid(d.dtype) ? DTypeName(static_cast<DType>(d.dtype)) : "bad dtype", ", ", kind, ")");
}

std::string MismatchMessage(uint32_t lane, uint32_t rank, const CollectiveDesc& mine, uint32_t prev_rank,
                            const CollectiveDesc& theirs) {
  const bool shapes_differ = theirs.name_hash == mine.name_hash && theirs.total_bytes == mine.total_bytes &&
                             theirs.shape_hash != mine.shape_hash;
  return Str("collective mismatch on lane ", lane, ": rank ", rank, " runs ", DescribeCollective(mine), " but rank ",
             prev_rank, " runs ", DescribeCollective(theirs), shapes_differ ? "; the shapes differ" : "",
             ". The ranks' proxies left the negotiated order (a FastHorovod bug: please report it with this "
             "message); the lane is unusable from here on.");
}

}  // namespace fasthorovod
