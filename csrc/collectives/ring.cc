// The ring allreduce of one lane: the schedule. Moving the frames is the lane transport's job
// (transport/lane.h: framing, striping over sockets, end markers, header checks, aborts, deadlines).
//
// Every rank holds the same-length shard of a tensor (the lane's part of it) and the ranks form a
// ring: each receives only from the previous rank and sends only to the next. The shard is cut
// into `size` chunks (chunk c covers elements [c·count/size, (c+1)·count/size), so the uneven tail
// is spread one element at a time, and a chunk may be empty when count < size). The algorithm runs
// 2·(size−1) steps:
//
//   reduce-scatter, step t = 0 … size−2: send chunk (rank−t), receive chunk (rank−t−1) and add it
//     into the local copy. After the last step this rank holds chunk (rank+1) fully reduced; the
//     postscale (1/size for Average, times Horovod's postscale factor) is applied to it here, once.
//   allgather, step t = 0 … size−2: send chunk (rank+1−t), receive chunk (rank−t) into place.
//
// An allgather (op kGather, e.g. the scheduler's packed 2-bit payloads) runs the allgather steps
// only: each rank starts with its own data in chunk rank+1 (AllgatherOwnChunk) and ends with
// every rank's. A reduce-scatter (op kReduceScatter) runs the reduce-scatter steps only: each rank
// ends with chunk rank+1 reduced and postscaled (the same AllgatherOwnChunk), the rest partial.
//
// The chunk sent at step t+1 is always the chunk received at step t. Chunks are cut further into
// segments of at most `segment_bytes`, and each segment travels as one frame {step, segment,
// offset, length} on one of the lane's S sockets. A frame travels whole on one socket, so a chunk
// of one segment would leave the other S − 1 idle (behind a per-flow cap, the lane would get one
// flow's rate): a chunk is cut into at least S segments, down to kMinRingSegmentBytes
// (RingSegmentElements); every rank computes the same cut from the same request and settings. (An
// empty chunk still travels as one empty frame, so that its header is checked.) Segment i of step
// t+1 may leave as soon as segment i of step t has arrived and been reduced, so the schedule is a
// pipeline: all segments of the first step are queued at once, every arriving segment releases
// the next step's segment, and sends, receives and reductions overlap (the kernel's socket buffers
// keep filling while a segment is being reduced).
//
// In the hierarchical allreduce the shard is this local rank's part of the host's data
// (ShardWork::host): the host's other contributions are added into a segment right before its
// first use (the first step's sends are queued at the start, so 1/size of the shard is reduced in
// the host before anything leaves; every other segment when its neighbour's segment arrives), and
// every segment is copied out to the host's other ranks as soon as it is final (after the last
// reduce-scatter step, or when it arrives in the allgather). The shared-memory work thus overlaps
// the network's instead of preceding and following it.
//
// Compression on the wire (the dtypes kFloat32WireFloat16/BFloat16: float32 in memory). Every frame
// carries the segment rounded to the 16-bit wire type, converted into a wire copy of the shard just
// before a reduce-scatter step queues it; a reduce-scatter payload is added into the float32 shard in
// float32, and an allgather payload lands in the wire copy, is converted into the shard and is
// forwarded from the wire copy as it came. The owner of a chunk
// rounds its final values to the wire type too before it sends them, so that every rank ends with
// the same values (what the wire can carry). Frame offsets and lengths count wire bytes.
//
// Reduce-scatter payloads land in a per-socket temporary of one segment and are added into the
// shard (the lane reads one frame per socket at a time); allgather payloads land in place. The
// ring checks that every received frame is one the schedule expects (step, segment and bounds,
// computed from this rank's own request, never from the peer's header) and that it arrives only
// once, before the lane reads a byte of its payload; the lane has already checked that it belongs
// to the same collective.
#include "collectives/ring.h"

#include <algorithm>
#include <vector>

#include "common/clock.h"

namespace fasthorovod {
namespace {

class RingRun : public FrameSink {
 public:
  RingRun(RingLinks& links, const CollectiveDesc& desc, const ShardWork& work, const RingOptions& opt)
      : lane_(links, opt), desc_(desc), work_(work), opt_(opt), elem_(DTypeSize(work.dtype)),
        wire_(WireDType(work.dtype)), compressed_(WireCompressed(work.dtype)), unit_(DTypeSize(wire_)) {
    seg_elems_ = RingSegmentElements(work.count, opt.size, links.to_next.size(), opt.segment_bytes, unit_);
    steps_ = desc.op == static_cast<uint32_t>(ReduceOp::kReduceScatter) ? opt.size - 1 : 2 * (opt.size - 1);
    first_step_ = desc.op == static_cast<uint32_t>(ReduceOp::kGather) ? opt.size - 1 : 0;
    temp_.resize(links.from_prev.size());
  }

  Status Run(RingStats* stats) {
    stats->start_ns = NowNs();
    Status st = Execute(stats);
    stats->end_ns = NowNs();
    return st;
  }

  // FrameSink: a header arrived; it must be a frame of the schedule, and says where it goes.
  Status Accept(const Frame& f, size_t socket, char** payload) override {
    if (f.step < first_step_ || f.step >= steps_) {
      return Status::Error(Code::kIoError, Str("frame with step ", f.step, " (the schedule has steps ", first_step_,
                                               "..", steps_ - 1, ")"));
    }
    const size_t segments = Segments(RecvChunk(f.step));
    if (f.segment >= segments) {
      return Status::Error(Code::kIoError, Str("frame of step ", f.step, " with segment ", f.segment, " (the step has ",
                                               segments, ")"));
    }
    size_t begin, end;
    SegmentRange(RecvChunk(f.step), f.segment, &begin, &end);
    if (f.offset != begin * unit_ || f.length != (end - begin) * unit_) {
      return Status::Error(Code::kIoError, Str("frame of step ", f.step, " segment ", f.segment, " with offset ",
                                               f.offset, " and length ", f.length, " (the schedule says offset ",
                                               begin * unit_, ", length ", (end - begin) * unit_, ")"));
    }
    // Each frame of the schedule arrives once: a repeat would be reduced twice and release a send twice.
    const size_t index = step_base_[f.step - first_step_] + f.segment;
    if (received_[index]) {
      return Status::Error(Code::kIoError, Str("frame of step ", f.step, " segment ", f.segment, " sent twice"));
    }
    received_[index] = true;
    *payload = f.step < opt_.size - 1 ? temp_[socket].data() : compressed_ ? Wire(begin) : Bytes(begin);
    return Status::Ok();
  }

  // FrameSink: segment f.segment of step f.step is in: reduce it and release the next step's.
  void Received(const Frame& f, size_t socket) override {
    const size_t begin = f.offset / unit_, count = f.length / unit_;
    if (f.step < opt_.size - 1 && count > 0) {
      if (work_.host != nullptr) work_.host->ReduceIn(begin, count);
      if (compressed_) {
        AddFromWire(wire_, Floats(begin), temp_[socket].data(), count);
      } else {
        ReduceSum(work_.dtype, Bytes(begin), temp_[socket].data(), count);
      }
      if (f.step == opt_.size - 2) {
        Scale(work_.dtype, Bytes(begin), count, work_.postscale);
        if (compressed_) {  // the owner keeps what the others will receive
          ToWire(wire_, Wire(begin), Floats(begin), count);
          FromWire(wire_, Floats(begin), Wire(begin), count);
        }
      }
    } else if (compressed_ && count > 0) {
      FromWire(wire_, Floats(begin), Wire(begin), count);
    }
    if (f.step + 1 < steps_) QueueSend(f.step + 1, f.segment);
    if (work_.host != nullptr && f.step >= opt_.size - 2 && count > 0) work_.host->CopyOut(begin, count);
  }

 private:
  uint32_t Mod(int64_t x) const { return static_cast<uint32_t>(((x % opt_.size) + opt_.size) % opt_.size); }
  uint32_t SendChunk(uint32_t t) const {
    return t < opt_.size - 1 ? Mod(int64_t(opt_.rank) - t) : Mod(int64_t(opt_.rank) + 1 - (t - (opt_.size - 1)));
  }
  uint32_t RecvChunk(uint32_t t) const {
    return t < opt_.size - 1 ? Mod(int64_t(opt_.rank) - t - 1) : Mod(int64_t(opt_.rank) - (t - (opt_.size - 1)));
  }
  size_t ChunkElems(uint32_t c) const {
    return ChunkBegin(work_.count, opt_.size, c + 1) - ChunkBegin(work_.count, opt_.size, c);
  }
  size_t Segments(uint32_t c) const { return SegmentCount(ChunkElems(c), seg_elems_); }
  // Element range [begin, end) of segment i of chunk c.
  void SegmentRange(uint32_t c, size_t i, size_t* begin, size_t* end) const {
    size_t chunk_begin = ChunkBegin(work_.count, opt_.size, c);
    size_t chunk_end = chunk_begin + ChunkElems(c);
    *begin = std::min(chunk_end, chunk_begin + i * seg_elems_);
    *end = std::min(chunk_end, *begin + seg_elems_);
  }
  char* Bytes(size_t element) const { return static_cast<char*>(work_.data) + element * elem_; }
  float* Floats(size_t element) const { return reinterpret_cast<float*>(Bytes(element)); }
  char* Wire(size_t element) { return wire_copy_.data() + element * unit_; }

  void QueueSend(uint32_t step, size_t segment) {
    size_t begin, end;
    SegmentRange(SendChunk(step), segment, &begin, &end);
    Frame f;
    f.step = step;
    f.segment = static_cast<uint32_t>(segment);
    f.offset = begin * unit_;
    f.length = (end - begin) * unit_;
    if (compressed_) {
      // An allgather step forwards what the wire copy holds already: the owner's rounded values or
      // the payload received into it.
      if (step < opt_.size - 1) ToWire(wire_, Wire(begin), Floats(begin), end - begin);
      lane_.Send(f, Wire(begin));
    } else {
      lane_.Send(f, Bytes(begin));
    }
  }

  Status Execute(RingStats* stats) {
    const bool gather = desc_.op == static_cast<uint32_t>(ReduceOp::kGather);
    if (compressed_ && (gather || desc_.op == static_cast<uint32_t>(ReduceOp::kBroadcast))) {
      return Status::Error(Code::kInvalidArgument, Str(DTypeName(work_.dtype), " is a compression of sums only"));
    }
    if (work_.host != nullptr && (RowsPerRank(desc_.op) || work_.prescale != 1.0)) {
      return Status::Error(Code::kInvalidArgument, "a host's contributions are summed (not gathered) and prescaled "
                                                   "by their owners");
    }
    if (!gather) Scale(work_.dtype, work_.data, work_.count, work_.prescale);
    if (opt_.size == 1) {
      if (!gather) ReduceWithoutRing(work_, opt_.segment_bytes);
      return Status::Ok();
    }
    uint64_t frames_in = 0, frames_out = 0;
    step_base_.clear();
    for (uint32_t t = first_step_; t < steps_; ++t) {
      step_base_.push_back(frames_in);
      frames_in += Segments(RecvChunk(t));
      frames_out += Segments(SendChunk(t));
    }
    received_.assign(frames_in, false);
    for (auto& temp : temp_) temp.resize(seg_elems_ * unit_);
    if (compressed_) wire_copy_.resize(work_.count * unit_);
    lane_.Begin(desc_, frames_out, frames_in);
    for (size_t i = 0; i < Segments(SendChunk(first_step_)); ++i) {
      if (work_.host != nullptr) {
        size_t begin, end;
        SegmentRange(SendChunk(first_step_), i, &begin, &end);
        if (end > begin) work_.host->ReduceIn(begin, end - begin);
      }
      QueueSend(first_step_, i);
    }
    return lane_.Run(this, stats);
  }

  Lane lane_;
  const CollectiveDesc& desc_;
  const ShardWork& work_;
  const RingOptions& opt_;
  const size_t elem_;        // bytes per element in memory
  const DType wire_;         // the elements' type on the wire
  const bool compressed_;    // wire_ is narrower than the memory type (compression on the wire)
  const size_t unit_;        // bytes per element on the wire: frame offsets and lengths count these
  size_t seg_elems_ = 1;
  uint32_t steps_ = 0;
  uint32_t first_step_ = 0;  // size-1 for an allgather (kGather): its steps are the allgather phase's
  std::vector<std::vector<char>> temp_;  // per receive socket: one reduce-scatter segment
  std::vector<uint64_t> step_base_;      // index of step (first_step_ + i)'s first frame in received_
  std::vector<bool> received_;           // per frame of the schedule: it has arrived
  std::vector<char> wire_copy_;          // compressed: the shard on the wire (what each frame carries)
};

}  // namespace

void ReduceWithoutRing(const ShardWork& work, size_t block_bytes) {
  const size_t elem = DTypeSize(work.dtype);
  const size_t block = std::max<size_t>(1, block_bytes / elem);
  const bool compressed = WireCompressed(work.dtype);
  std::vector<uint16_t> wire(compressed ? std::min(block, work.count) : 0);
  for (size_t at = 0; at < work.count; at += block) {
    const size_t len = std::min(block, work.count - at);
    if (work.host != nullptr) work.host->ReduceIn(at, len);
    char* data = static_cast<char*>(work.data) + at * elem;
    Scale(work.dtype, data, len, work.postscale);
    if (compressed) {  // no wire here, but the same values as a ring's: each a value of the wire type
      ToWire(WireDType(work.dtype), wire.data(), reinterpret_cast<float*>(data), len);
      FromWire(WireDType(work.dtype), reinterpret_cast<float*>(data), wire.data(), len);
    }
    if (work.host != nullptr) work.host->CopyOut(at, len);
  }
}

size_t ChunkBegin(size_t count, uint32_t size, uint32_t chunk) {
  return static_cast<size_t>((static_cast<unsigned __int128>(count) * chunk) / size);
}

uint32_t AllgatherOwnChunk(uint32_t rank, uint32_t size) { return (rank + 1) % size; }

size_t RingSegmentElements(size_t count, uint32_t size, size_t sockets, size_t segment_bytes, size_t elem) {
  size_t segment = std::max<size_t>(1, segment_bytes / elem);
  if (sockets > 1) {
    const size_t chunk = (count + size - 1) / std::max<uint32_t>(1, size);  // the largest chunk
    const size_t even = (chunk + sockets - 1) / sockets;
    segment = std::min(segment, std::max(even, std::max<size_t>(1, kMinRingSegmentBytes / elem)));
  }
  return segment;
}

size_t SegmentCount(size_t chunk_elements, size_t segment_elements) {
  // An empty chunk still travels as one empty frame so that its header is checked.
  return chunk_elements == 0 ? 1 : (chunk_elements + segment_elements - 1) / segment_elements;
}

Status RingAllreduce(RingLinks& links, const CollectiveDesc& desc, const ShardWork& work,
                     const RingOptions& options, RingStats* stats) {
  if (links.to_next.empty() || links.to_next.size() != links.from_prev.size()) {
    return Status::Error(Code::kInvalidArgument, "ring links are not established");
  }
  RingRun run(links, desc, work, options);
  return run.Run(stats);
}

}  // namespace fasthorovod
