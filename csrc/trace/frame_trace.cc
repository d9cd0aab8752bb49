#include "trace/frame_trace.h"

namespace fasthorovod {

static_assert(static_cast<uint8_t>(FrameDep::kOnRequest) == static_cast<uint8_t>(TraceDep::kOnRequest) &&
                  static_cast<uint8_t>(FrameDep::kOnReceive) == static_cast<uint8_t>(TraceDep::kOnReceive) &&
                  static_cast<uint8_t>(FrameDep::kOnPeerSend) == static_cast<uint8_t>(TraceDep::kOnPeerSend),
              "FrameDep values are TraceDep values");
static_assert(kNoRecord == -1, "the lane uses -1 for no record");

int64_t TraceFrameObserver::OnFrame(const CollectiveDesc& desc, const FrameEvent& e) {
  MessageRecord r;
  r.src = e.src;
  r.dst = e.dst;
  r.direction = static_cast<uint8_t>(e.send ? TraceDirection::kSend : TraceDirection::kRecv);
  r.seq = desc.seq;
  r.request = request_;
  r.name_hash = desc.name_hash;
  r.bytes = e.frame.length;  // payload only; the frame header is kFrameHeaderBytes more
  r.shard_bytes = desc.shard_bytes;
  r.ready_ns = e.ready_ns;
  r.start_ns = e.start_ns;
  r.end_ns = e.end_ns;
  r.step = e.frame.step;
  r.segment = e.frame.segment;
  r.lane = static_cast<uint16_t>(e.lane);
  r.socket = static_cast<uint16_t>(e.socket);
  r.op = static_cast<uint8_t>(desc.op == static_cast<uint32_t>(ReduceOp::kGather)          ? TraceOp::kAllgather
                              : desc.op == static_cast<uint32_t>(ReduceOp::kReduceScatter) ? TraceOp::kReducescatter
                                                                                           : TraceOp::kAllreduce);
  r.dep_type = static_cast<uint8_t>(e.dep);
  r.dep_id = e.dep_id;
  r.flags = flags_;
  return recorder_->Record(r);
}

}  // namespace fasthorovod
