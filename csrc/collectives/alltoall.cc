// The mesh alltoall's schedule (collectives/alltoall.h); the Lane moves and checks the frames.
#include "collectives/alltoall.h"

#include <algorithm>
#include <atomic>

#include "common/clock.h"
#include "transport/lane.h"

namespace fasthorovod {
namespace {

size_t Align64(size_t x) { return (x + 63) & ~size_t{63}; }

// One step: this lane's parts of the block for rank + d (sent) and of the block from rank - d
// (received).
class AlltoallStep : public FrameSink {
 public:
  AlltoallStep(const AlltoallWork& work, uint32_t rank, uint32_t size, uint32_t distance, size_t sockets,
               size_t segment_bytes)
      : distance_(distance), elem_(DTypeSize(work.dtype)) {
    const uint32_t dst = (rank + distance) % size, src = (rank + size - distance) % size;
    Part(work, work.send_count, dst, &send_begin_, &send_elems_);
    Part(work, work.recv_count, src, &recv_begin_, &recv_elems_);
    send_ = work.send + send_begin_ * elem_;
    recv_ = work.recv + recv_begin_ * elem_;
    send_seg_ = RingSegmentElements(send_elems_, 1, sockets, segment_bytes, elem_);
    recv_seg_ = RingSegmentElements(recv_elems_, 1, sockets, segment_bytes, elem_);
    received_.assign(SegmentCount(recv_elems_, recv_seg_), false);
  }

  uint64_t FramesOut() const { return SegmentCount(send_elems_, send_seg_); }
  uint64_t FramesIn() const { return received_.size(); }

  void QueueAll(Lane* lane) const {
    for (size_t i = 0; i < FramesOut(); ++i) {
      Frame f;
      f.step = distance_;
      f.segment = static_cast<uint32_t>(i);
      const size_t begin = std::min(send_elems_, i * send_seg_);
      f.offset = begin * elem_;
      f.length = (std::min(send_elems_, begin + send_seg_) - begin) * elem_;
      lane->Send(f, send_ + f.offset);
    }
  }

  Status Accept(const Frame& f, size_t, char** payload) override {
    const size_t begin = std::min(recv_elems_, size_t{f.segment} * recv_seg_);
    const size_t end = std::min(recv_elems_, begin + recv_seg_);
    if (f.step != distance_ || f.segment >= received_.size() || f.offset != begin * elem_ ||
        f.length != (end - begin) * elem_) {
      return Status::Error(Code::kIoError,
                           Str("alltoall frame of distance ", f.step, " segment ", f.segment, " with offset ", f.offset,
                               " and length ", f.length, " (this rank expects distance ", distance_, ", ",
                               received_.size(), " segments of its ", recv_elems_ * elem_, " bytes)"));
    }
    if (received_[f.segment]) return Status::Error(Code::kIoError, Str("alltoall segment ", f.segment, " sent twice"));
    received_[f.segment] = true;
    *payload = recv_ + f.offset;
    return Status::Ok();
  }

  void Received(const Frame&, size_t) override {}

 private:
  // Block `rank`'s place in a region laid out by `counts`, and this lane's part of it (elements).
  static void Part(const AlltoallWork& work, const std::vector<uint64_t>& counts, uint32_t rank, size_t* begin,
                   size_t* elems) {
    size_t at = 0;
    for (uint32_t r = 0; r < rank; ++r) at += counts[r];
    const size_t lo = ChunkBegin(counts[rank], work.lanes, work.lane);
    *begin = at + lo;
    *elems = ChunkBegin(counts[rank], work.lanes, work.lane + 1) - lo;
  }

  const uint32_t distance_;
  const size_t elem_;
  size_t send_begin_ = 0, send_elems_ = 0, recv_begin_ = 0, recv_elems_ = 0;
  size_t send_seg_ = 1, recv_seg_ = 1;
  const char* send_ = nullptr;
  char* recv_ = nullptr;
  std::vector<bool> received_;
};

LaneOptions StepOptions(const RingOptions& options, uint32_t distance) {
  LaneOptions o = options;
  o.distance = distance;
  o.socket_counters = nullptr;  // the rings' sockets, not these
  o.rehash_out = 0;
  const uint32_t n = options.size;
  o.prev_name = Str("rank ", (options.rank + n - distance) % n, " lane ", options.lane, " (mesh)");
  o.next_name = Str("rank ", (options.rank + distance) % n, " lane ", options.lane, " (mesh)");
  return o;
}

// After a failed step: an abort frame to the rank at every other distance (alltoall.h, Failure).
void TellEveryone(std::vector<RingLinks>& by_distance, const CollectiveDesc& desc, const RingOptions& options,
                  uint32_t failed, const Status& why) {
  std::atomic<uint32_t> raised{1};
  const uint32_t code = static_cast<uint32_t>(why.code());
  const std::string reason = why.message();
  for (uint32_t d = 1; d < options.size; ++d) {
    if (d == failed) continue;
    LaneOptions o = StepOptions(options, d);
    o.abort = &raised;
    o.abort_reason = reason.c_str();
    o.abort_code = &code;
    o.timeout_seconds = 2.0;
    Lane lane(by_distance[d], o);
    lane.Begin(desc, 0, 0);
    LaneStats unused;
    (void)lane.Run(nullptr, &unused);  // fails at once, after sending the abort
  }
}

}  // namespace

AlltoallLayout AlltoallLayoutOf(const std::vector<uint64_t>& send_count, const std::vector<uint64_t>& recv_count,
                                size_t elem) {
  AlltoallLayout l;
  size_t sent = 0, received = 0;
  for (uint64_t c : send_count) sent += c;
  for (uint64_t c : recv_count) received += c;
  l.send_offset = Align64(sizeof(uint64_t) * (send_count.size() + recv_count.size()));
  l.recv_offset = l.send_offset + Align64(sent * elem);
  l.total_bytes = l.recv_offset + received * elem;
  return l;
}

Status MeshAlltoall(std::vector<RingLinks>& by_distance, const CollectiveDesc& desc, const AlltoallWork& work,
                    const RingOptions& options, RingStats* stats) {
  const uint32_t n = options.size;
  stats->start_ns = NowNs();
  if (by_distance.size() != n || work.send_count.size() != n || work.recv_count.size() != n ||
      work.lane >= work.lanes) {
    return Status::Error(Code::kInvalidArgument, "the alltoall's mesh or size table does not match the ranks");
  }
  for (uint32_t i = 0; i + 1 < n; ++i) {
    const uint32_t d = (work.lane + i) % (n - 1) + 1;
    AlltoallStep step(work, options.rank, n, d, by_distance[d].to_next.size(), options.segment_bytes);
    Lane lane(by_distance[d], StepOptions(options, d));
    lane.Begin(desc, step.FramesOut(), step.FramesIn());
    step.QueueAll(&lane);
    LaneStats lane_stats;
    Status st = lane.Run(&step, &lane_stats);
    stats->bytes_sent += lane_stats.bytes_sent;
    stats->bytes_received += lane_stats.bytes_received;
    stats->frames_sent += lane_stats.frames_sent;
    stats->frames_received += lane_stats.frames_received;
    if (!st.ok()) {
      TellEveryone(by_distance, desc, options, d, st);
      stats->end_ns = NowNs();
      return st;
    }
  }
  stats->end_ns = NowNs();
  return Status::Ok();
}

}  // namespace fasthorovod
