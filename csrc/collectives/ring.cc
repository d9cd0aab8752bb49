// The ring allreduce of one lane.
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
// every rank's.
//
// The chunk sent at step t+1 is always the chunk received at step t. Chunks are cut further into
// segments of at most `segment_bytes`, and each segment travels as one frame: a 128-byte header
// ({seq, name hash, shape hash, sizes, dtype, op, step, segment, offset, length}) and its payload.
// Segment i of step t+1 may leave as soon as segment i of step t has arrived and been reduced,
// so the schedule is a pipeline: all segments of step 0 are queued at once, every arriving
// segment releases the next step's segment, and sends, receives and reductions overlap (the
// kernel's socket buffers keep filling while a segment is being reduced). A lane may use several
// sockets per neighbour; frames ready to go wait in one queue and each goes out on whichever
// socket can take it first, so a socket whose flow is slower (an unlucky share of a shaped link)
// carries fewer frames instead of holding the collective back. Once its last frame is out, the
// sender closes the collective on every socket with an end marker (a header without payload), so
// each receiver knows when a socket's frames of this collective are over and never reads into the
// next collective's.
//
// Every header is compared with the receiver's own description of the collective; a difference
// means the ranks issued different collectives (order, size, dtype, op, shape) and fails the lane
// with a message naming both ranks and both tensors. The failing rank then sends an abort frame
// carrying that message to the next rank, which forwards it, so the whole ring reports the same
// cause. Waits are bounded: if no byte moves for `timeout_seconds`, the lane fails naming the
// neighbour it was waiting for.
#include "collectives/ring.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <vector>

#include "common/clock.h"

namespace fasthorovod {
namespace {

enum FrameKind : uint32_t { kData = 1, kAbort = 2, kEnd = 3 };
constexpr size_t kMaxAbortMessage = 4096;

struct FrameHeader {
  uint32_t magic;
  uint32_t kind;
  uint64_t seq;
  uint64_t name_hash;
  uint64_t shape_hash;
  uint64_t total_bytes;
  uint64_t shard_bytes;
  uint32_t dtype;
  uint32_t op;
  uint32_t step;
  uint32_t segment;
  uint64_t offset;  // bytes into the shard
  uint64_t length;  // payload bytes
  uint32_t origin_rank;
  uint32_t epoch;
  double postscale;
  char name[kWireNameBytes];
};
static_assert(sizeof(FrameHeader) == 128, "frame header is part of the wire format");

struct OutFrame {
  FrameHeader header;
  const char* payload;
  size_t sent = 0;  // bytes of header + payload already written
  int64_t ready_ns = 0;  // trace: queued
  int64_t start_ns = 0;  // trace: first byte written
  int64_t dep_id = kNoRecord;
  uint8_t dep_type = 0;
  size_t total() const { return sizeof(FrameHeader) + header.length; }
};

struct InState {
  FrameHeader header;
  size_t header_got = 0;
  size_t payload_got = 0;
  char* payload_dst = nullptr;
  bool ended = false;  // this socket's end marker of the collective arrived
  int64_t start_ns = 0;  // trace: first byte of the current frame
};

std::string DescribeDesc(const char* name, uint64_t seq, uint64_t total, uint64_t shard, uint32_t dtype,
                         uint32_t op) {
  std::string n(name, strnlen(name, kWireNameBytes));
  const char* kind = op == static_cast<uint32_t>(ReduceOp::kAverage) ? "average"
                     : op == static_cast<uint32_t>(ReduceOp::kGather) ? "allgather"
                                                                      : "sum";
  return Str("tensor '", n, "' (collective #", seq, ", ", total, " bytes, lane shard ", shard, " bytes, ",
             DTypeValid(dtype) ? DTypeName(static_cast<DType>(dtype)) : "bad dtype", ", ", kind, ")");
}

// Reads the message of an abort frame whose header `h` was just received on fd.
Status ReceiveAbort(int fd, const FrameHeader& h, const std::string& prev_name, int64_t* origin) {
  *origin = h.origin_rank;
  std::string message(std::min<uint64_t>(h.length, kMaxAbortMessage), '\0');
  if (!RecvAll(fd, message.data(), message.size(), Deadline::After(2.0), prev_name).ok()) {
    message = "(message lost)";
  }
  return Status::Error(Code::kPeerError, Str(message, " [reported by rank ", h.origin_rank, "]"));
}

class RingRun {
 public:
  RingRun(RingLinks& links, const CollectiveDesc& desc, const ShardWork& work, const RingOptions& opt)
      : links_(links), desc_(desc), work_(work), opt_(opt), elem_(DTypeSize(work.dtype)) {
    seg_elems_ = std::max<size_t>(1, opt.segment_bytes / elem_);
    steps_ = 2 * (opt.size - 1);
    first_step_ = desc.op == static_cast<uint32_t>(ReduceOp::kGather) ? opt.size - 1 : 0;
    out_.resize(links.to_next.size());
    end_sent_.assign(links.to_next.size(), false);
    in_.resize(links.from_prev.size());
    temp_.resize(links.from_prev.size());
  }

  Status Run(RingStats* stats) {
    stats->start_ns = NowNs();
    Status st = Execute(stats);
    if (!st.ok()) {
      if (abort_origin_ < 0) abort_origin_ = static_cast<int64_t>(opt_.rank);
      if ((static_cast<uint32_t>(abort_origin_) != (opt_.rank + 1) % opt_.size)) SendAbort(st.message());
    }
    stats->end_ns = NowNs();
    return st;
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

  void QueueSend(uint32_t step, size_t segment, int64_t dep_id, TraceDep dep_type) {
    uint32_t c = SendChunk(step);
    size_t begin, end;
    SegmentRange(c, segment, &begin, &end);
    OutFrame f;
    std::memset(&f.header, 0, sizeof(f.header));
    FillHeader(&f.header, kData);
    f.header.step = step;
    f.header.segment = static_cast<uint32_t>(segment);
    f.header.offset = begin * elem_;
    f.header.length = (end - begin) * elem_;
    f.payload = Bytes(begin);
    if (opt_.trace != nullptr) {
      f.ready_ns = NowNs();
      f.dep_id = dep_id;
      f.dep_type = static_cast<uint8_t>(dep_type);
    }
    pending_.push_back(f);
    ++frames_queued_;
  }

  void FillHeader(FrameHeader* h, uint32_t kind) const {
    h->magic = kFrameMagic;
    h->kind = kind;
    h->seq = desc_.seq;
    h->name_hash = desc_.name_hash;
    h->shape_hash = desc_.shape_hash;
    h->total_bytes = desc_.total_bytes;
    h->shard_bytes = desc_.shard_bytes;
    h->dtype = desc_.dtype;
    h->op = desc_.op;
    h->origin_rank = opt_.rank;
    h->epoch = desc_.epoch;
    h->postscale = desc_.postscale;
    std::memcpy(h->name, desc_.name, kWireNameBytes);
  }

  Status Execute(RingStats* stats) {
    const bool gather = desc_.op == static_cast<uint32_t>(ReduceOp::kGather);
    if (!gather) Scale(work_.dtype, work_.data, work_.count, work_.prescale);
    if (opt_.size == 1) {
      if (!gather) Scale(work_.dtype, work_.data, work_.count, work_.postscale);
      return Status::Ok();
    }
    uint64_t frames_in = 0;
    for (uint32_t t = first_step_; t < steps_; ++t) {
      frames_in += Segments(RecvChunk(t));
      frames_out_ += Segments(SendChunk(t));
    }
    for (size_t s = 0; s < in_.size(); ++s) temp_[s].resize(seg_elems_ * elem_);
    recv_remaining_ = frames_in;
    for (size_t i = 0; i < Segments(SendChunk(first_step_)); ++i) {
      QueueSend(first_step_, i, kNoRecord, TraceDep::kOnRequest);
    }

    std::vector<pollfd> fds(out_.size() + in_.size());
    int64_t last_progress = NowNs();
    const int64_t timeout_ns = static_cast<int64_t>(opt_.timeout_seconds * 1e9);
    while (ReceivesPending() || SendsPending()) {
      if (opt_.abort != nullptr && opt_.abort->load(std::memory_order_acquire) != 0) {
        const bool known = opt_.abort_reason != nullptr && opt_.abort_reason[0] != '\0';
        return Status::Error(Code::kAborted, Str("rank ", opt_.rank, " aborted its collectives: ",
                                                 known ? opt_.abort_reason : "the job is shutting down"));
      }
      for (size_t s = 0; s < out_.size(); ++s) {
        fds[s] = {links_.to_next[s].fd(), static_cast<short>(SocketHasWork(s) ? POLLOUT : 0), 0};
      }
      for (size_t s = 0; s < in_.size(); ++s) {
        fds[out_.size() + s] = {links_.from_prev[s].fd(), static_cast<short>(in_[s].ended ? 0 : POLLIN), 0};
      }
      int rc = poll(fds.data(), fds.size(), 100);
      if (rc < 0 && errno != EINTR) return Status::Error(Code::kIoError, "poll(): " + ErrnoString(errno));
      bool progressed = false;
      // Receive first: if the next rank has gone, an abort frame explaining why may already be
      // waiting on the receive side, and it is a better error than the broken send.
      for (size_t s = 0; s < in_.size(); ++s) {
        if (fds[out_.size() + s].revents & (POLLIN | POLLHUP | POLLERR)) {
          FHVD_RETURN_IF_ERROR(PumpRecv(s, stats, &progressed));
        }
      }
      for (size_t s = 0; s < out_.size(); ++s) {
        if (fds[s].revents & (POLLERR | POLLHUP)) {
          FHVD_RETURN_IF_ERROR(ReadPendingAbort());
          return Status::Error(Code::kIoError, Str("connection to ", opt_.next_name, " broke (peer died or closed)"));
        }
        if (fds[s].revents & POLLOUT) FHVD_RETURN_IF_ERROR(PumpSend(s, stats, &progressed));
      }
      if (progressed) {
        last_progress = NowNs();
        if (opt_.progress_ns != nullptr) opt_.progress_ns->store(last_progress, std::memory_order_relaxed);
      } else if (NowNs() - last_progress > timeout_ns) {
        return Status::Error(
            Code::kTimeout,
            recv_remaining_ > 0
                ? Str("timed out after ", opt_.timeout_seconds, " s waiting for data from ", opt_.prev_name,
                      " (it may be stopped, dead, or running a different collective)")
                : Str("timed out after ", opt_.timeout_seconds, " s sending to ", opt_.next_name,
                      " (it is not reading: stopped or stuck)"));
      }
    }
    return Status::Ok();
  }

  // Socket s has something to write: its frame in progress, a frame from the shared queue, or
  // (all frames out) its end marker.
  bool SocketHasWork(size_t s) const {
    return !out_[s].empty() || !pending_.empty() || (frames_queued_ == frames_out_ && !end_sent_[s]);
  }

  bool SendsPending() const {
    for (size_t s = 0; s < out_.size(); ++s) {
      if (SocketHasWork(s)) return true;
    }
    return false;
  }

  bool ReceivesPending() const {
    if (recv_remaining_ > 0) return true;
    for (const auto& in : in_) {
      if (!in.ended) return true;
    }
    return false;
  }

  // Takes the socket's next frame: the oldest queued one (frames are queued in pipeline order), or
  // its end marker once every frame of the collective has been handed to some socket.
  bool TakeNext(size_t s) {
    if (!pending_.empty()) {
      out_[s].push_back(pending_.front());
      pending_.pop_front();
      return true;
    }
    if (frames_queued_ == frames_out_ && !end_sent_[s]) {
      OutFrame f;
      std::memset(&f.header, 0, sizeof(f.header));
      FillHeader(&f.header, kEnd);
      f.payload = nullptr;
      out_[s].push_back(f);
      end_sent_[s] = true;
      return true;
    }
    return false;
  }

  Status PumpSend(size_t s, RingStats* stats, bool* progressed) {
    auto& queue = out_[s];
    while (!queue.empty() || TakeNext(s)) {
      OutFrame& f = queue.front();
      if (opt_.trace != nullptr && f.sent == 0) f.start_ns = NowNs();
      iovec iov[2];
      int n = 0;
      if (f.sent < sizeof(FrameHeader)) {
        iov[n++] = {reinterpret_cast<char*>(&f.header) + f.sent, sizeof(FrameHeader) - f.sent};
        if (f.header.length > 0) iov[n++] = {const_cast<char*>(f.payload), f.header.length};
      } else {
        size_t done = f.sent - sizeof(FrameHeader);
        iov[n++] = {const_cast<char*>(f.payload) + done, f.header.length - done};
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = n;
      ssize_t w = sendmsg(links_.to_next[s].fd(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return Status::Ok();
        return Status::Error(Code::kIoError, Str("send to ", opt_.next_name, " failed: ", ErrnoString(errno),
                                                 " (peer died or closed the connection)"));
      }
      *progressed = true;
      f.sent += static_cast<size_t>(w);
      const bool marker = f.header.kind == kEnd;  // counted in no statistic, traced as no frame
      if (!marker) stats->bytes_sent += static_cast<uint64_t>(w);
      if (f.sent < f.total()) return Status::Ok();
      if (marker) {
        queue.pop_front();
        continue;
      }
      stats->frames_sent++;
      if (opt_.trace != nullptr) {
        TraceFrame(f.header, TraceDirection::kSend, s, f.ready_ns, f.start_ns, f.dep_id, f.dep_type);
      }
      queue.pop_front();
    }
    return Status::Ok();
  }

  Status PumpRecv(size_t s, RingStats* stats, bool* progressed) {
    InState& in = in_[s];
    const int fd = links_.from_prev[s].fd();
    while (!in.ended) {
      ssize_t r;
      if (in.header_got < sizeof(FrameHeader)) {
        r = recv(fd, reinterpret_cast<char*>(&in.header) + in.header_got, sizeof(FrameHeader) - in.header_got,
                 MSG_DONTWAIT);
      } else {
        r = recv(fd, in.payload_dst + in.payload_got, in.header.length - in.payload_got, MSG_DONTWAIT);
      }
      if (r == 0) {
        return Status::Error(Code::kIoError, Str(opt_.prev_name, " closed the connection in the middle of collective #",
                                                 desc_.seq, " (its proxy or worker died or failed)"));
      }
      if (r < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return Status::Ok();
        return Status::Error(Code::kIoError, Str("receive from ", opt_.prev_name, " failed: ", ErrnoString(errno)));
      }
      if (opt_.trace != nullptr && in.header_got == 0) in.start_ns = NowNs();
      *progressed = true;
      if (in.header_got < sizeof(FrameHeader)) {
        in.header_got += static_cast<size_t>(r);
        if (in.header_got < sizeof(FrameHeader)) continue;
        FHVD_RETURN_IF_ERROR(AcceptHeader(s));
        if (in.header.kind == kAbort) return ReadAbort(fd, in.header);
        if (in.header.kind == kEnd) {
          in.header_got = 0;
          in.ended = true;
          if (recv_remaining_ > 0 && AllEnded()) {
            return Status::Error(Code::kIoError, Str("protocol error from ", opt_.prev_name, ": collective #",
                                                     desc_.seq, " ended ", recv_remaining_, " frames early"));
          }
          break;
        }
        stats->bytes_received += sizeof(FrameHeader);
        if (in.header.length > 0) continue;
      } else {
        in.payload_got += static_cast<size_t>(r);
        stats->bytes_received += static_cast<uint64_t>(r);
        if (in.payload_got < in.header.length) continue;
      }
      FinishFrame(s);
      stats->frames_received++;
    }
    return Status::Ok();
  }

  // Validates a complete header and decides where its payload goes.
  Status AcceptHeader(size_t s) {
    InState& in = in_[s];
    const FrameHeader& h = in.header;
    const uint32_t prev_rank = (opt_.rank + opt_.size - 1) % opt_.size;
    if (h.magic != kFrameMagic) {
      return Status::Error(Code::kIoError, Str("corrupt frame from ", opt_.prev_name, " (bad magic)"));
    }
    if (h.kind == kAbort) return Status::Ok();
    if (h.kind != kData && h.kind != kEnd) {
      return Status::Error(Code::kIoError, Str("corrupt frame from ", opt_.prev_name, " (unknown kind ", h.kind, ")"));
    }
    if (h.seq != desc_.seq || h.name_hash != desc_.name_hash || h.shape_hash != desc_.shape_hash ||
        h.total_bytes != desc_.total_bytes || h.shard_bytes != desc_.shard_bytes || h.dtype != desc_.dtype ||
        h.op != desc_.op || h.epoch != desc_.epoch) {
      abort_origin_ = opt_.rank;
      return Status::Error(
          Code::kMismatch,
          Str("collective mismatch on lane ", opt_.lane, ": rank ", opt_.rank, " runs ",
              DescribeDesc(desc_.name, desc_.seq, desc_.total_bytes, desc_.shard_bytes, desc_.dtype, desc_.op),
              " but rank ", prev_rank, " runs ",
              DescribeDesc(h.name, h.seq, h.total_bytes, h.shard_bytes, h.dtype, h.op),
              (h.name_hash == desc_.name_hash && h.total_bytes == desc_.total_bytes && h.shape_hash != desc_.shape_hash
                   ? "; the shapes differ"
                   : ""),
              ". Large allreduces must be issued in the same order, with the same shapes, dtypes and ops, "
              "on every rank."));
    }
    if (h.kind == kEnd) return Status::Ok();
    if (recv_remaining_ == 0) {
      return Status::Error(Code::kIoError, Str("protocol error from ", opt_.prev_name, ": more frames than collective #",
                                               desc_.seq, " has"));
    }
    if (h.step < first_step_ || h.step >= steps_ || h.segment >= Segments(RecvChunk(h.step))) {
      return Status::Error(Code::kIoError, Str("protocol error from ", opt_.prev_name, ": step ", h.step,
                                               " segment ", h.segment, " out of range"));
    }
    size_t begin, end;
    SegmentRange(RecvChunk(h.step), h.segment, &begin, &end);
    if (h.offset != begin * elem_ || h.length != (end - begin) * elem_) {
      return Status::Error(Code::kIoError, Str("protocol error from ", opt_.prev_name, ": segment bounds differ"));
    }
    in.payload_got = 0;
    // Reduce-scatter payloads land in a temporary and are added; allgather payloads land in place.
    in.payload_dst = h.step < opt_.size - 1 ? temp_[s].data() : Bytes(begin);
    return Status::Ok();
  }

  // One trace record (the caller checked opt_.trace). Payload bytes only; the header is 128 more.
  int64_t TraceFrame(const FrameHeader& h, TraceDirection dir, size_t socket, int64_t ready_ns, int64_t start_ns,
                     int64_t dep_id, uint8_t dep_type) {
    MessageRecord r;
    const bool send = dir == TraceDirection::kSend;
    r.src = send ? opt_.rank : (opt_.rank + opt_.size - 1) % opt_.size;
    r.dst = send ? (opt_.rank + 1) % opt_.size : opt_.rank;
    r.direction = static_cast<uint8_t>(dir);
    r.seq = desc_.seq;
    r.request = opt_.trace_request;
    r.name_hash = desc_.name_hash;
    r.bytes = h.length;
    r.shard_bytes = desc_.shard_bytes;
    r.ready_ns = ready_ns;
    r.start_ns = start_ns;
    r.end_ns = NowNs();
    r.step = h.step;
    r.segment = h.segment;
    r.lane = static_cast<uint16_t>(opt_.lane);
    r.socket = static_cast<uint16_t>(socket);
    r.op = static_cast<uint8_t>(h.kind == kAbort                                         ? TraceOp::kAbort
                                : desc_.op == static_cast<uint32_t>(ReduceOp::kGather) ? TraceOp::kAllgather
                                                                                      : TraceOp::kAllreduce);
    r.dep_type = dep_type;
    r.dep_id = dep_id;
    r.flags = opt_.trace_flags;
    return opt_.trace->Record(r);
  }

  void FinishFrame(size_t s) {
    InState& in = in_[s];
    const FrameHeader& h = in.header;
    const int64_t recv_id = opt_.trace == nullptr ? kNoRecord
        : TraceFrame(h, TraceDirection::kRecv, s, in.start_ns, in.start_ns, kNoRecord,
                     static_cast<uint8_t>(TraceDep::kOnPeerSend));
    if (h.step < opt_.size - 1 && h.length > 0) {
      ReduceSum(work_.dtype, Bytes(h.offset / elem_), temp_[s].data(), h.length / elem_);
      if (h.step == opt_.size - 2) Scale(work_.dtype, Bytes(h.offset / elem_), h.length / elem_, work_.postscale);
    }
    if (h.step + 1 < steps_) QueueSend(h.step + 1, h.segment, recv_id, TraceDep::kOnReceive);
    in.header_got = 0;
    recv_remaining_--;
  }

  // The previous rank failed and sent its reason: fail with the same message.
  bool AllEnded() const {
    for (const auto& in : in_) {
      if (!in.ended) return false;
    }
    return true;
  }

  Status ReadAbort(int fd, const FrameHeader& h) { return ReceiveAbort(fd, h, opt_.prev_name, &abort_origin_); }

  // The send side broke: give the receive side a short chance to deliver an abort frame (the
  // reason the next rank went away, when it is also the previous rank or the abort went round).
  Status ReadPendingAbort() {
    std::vector<pollfd> fds;
    for (auto& sock : links_.from_prev) fds.push_back({sock.fd(), POLLIN, 0});
    RingStats ignored;
    bool progressed = false;
    Deadline deadline = Deadline::After(0.2);
    while (!deadline.Expired() && poll(fds.data(), fds.size(), deadline.RemainingMs(50)) > 0) {
      for (size_t s = 0; s < in_.size(); ++s) {
        if (fds[s].revents != 0) FHVD_RETURN_IF_ERROR(PumpRecv(s, &ignored, &progressed));
      }
    }
    return Status::Ok();
  }

  // Tells the next rank why this lane failed: finish any half-written frame (so the stream stays
  // framed), then send an abort frame with the message on every socket. Best effort, bounded.
  void SendAbort(const std::string& message) {
    std::string text = message.substr(0, kMaxAbortMessage);
    Deadline deadline = Deadline::After(2.0);
    for (size_t s = 0; s < out_.size(); ++s) {
      const int fd = links_.to_next[s].fd();
      if (!out_[s].empty() && out_[s].front().sent > 0) {
        OutFrame& f = out_[s].front();
        bool ok = true;
        if (f.sent < sizeof(FrameHeader)) {
          ok = SendAll(fd, reinterpret_cast<char*>(&f.header) + f.sent, sizeof(FrameHeader) - f.sent, deadline,
                       opt_.next_name).ok();
          f.sent = sizeof(FrameHeader);
        }
        size_t done = f.sent - sizeof(FrameHeader);
        if (!ok || !SendAll(fd, f.payload + done, f.header.length - done, deadline, opt_.next_name).ok()) continue;
      }
      FrameHeader h;
      std::memset(&h, 0, sizeof(h));
      FillHeader(&h, kAbort);
      h.origin_rank = static_cast<uint32_t>(abort_origin_);
      h.length = text.size();
      if (SendAll(fd, &h, sizeof(h), deadline, opt_.next_name).ok()) {
        SendAll(fd, text.data(), text.size(), deadline, opt_.next_name);
      }
    }
  }

  RingLinks& links_;
  const CollectiveDesc& desc_;
  const ShardWork& work_;
  const RingOptions& opt_;
  const size_t elem_;
  size_t seg_elems_ = 1;
  uint32_t steps_ = 0;
  uint32_t first_step_ = 0;  // size-1 for an allgather (kGather): its steps are the allgather phase's
  std::vector<std::deque<OutFrame>> out_;
  std::vector<InState> in_;
  std::vector<std::vector<char>> temp_;
  std::deque<OutFrame> pending_;  // frames ready to send, in pipeline order, not yet on a socket
  std::vector<bool> end_sent_;    // per socket: its end marker has been queued
  uint64_t frames_queued_ = 0;    // frames this rank has made ready so far
  uint64_t frames_out_ = 0;       // frames this rank sends in the whole collective
  uint64_t recv_remaining_ = 0;
  int64_t abort_origin_ = -1;
};

}  // namespace

Status PeekCollective(RingLinks& links, const RingOptions& options, int timeout_ms, bool* started,
                      CollectiveDesc* desc) {
  *started = false;
  const int fd = links.from_prev[0].fd();
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, timeout_ms) <= 0) return Status::Ok();
  FrameHeader h;
  ssize_t r = recv(fd, &h, sizeof(h), MSG_PEEK | MSG_DONTWAIT);
  if (r == 0) return Status::Error(Code::kIoError, Str(options.prev_name, " closed the connection"));
  if (r < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return Status::Ok();
    return Status::Error(Code::kIoError, Str("receive from ", options.prev_name, " failed: ", ErrnoString(errno)));
  }
  if (static_cast<size_t>(r) < sizeof(h)) return Status::Ok();  // the rest of the header is on its way
  if (h.magic != kFrameMagic) {
    return Status::Error(Code::kIoError, Str("corrupt frame from ", options.prev_name, " (bad magic)"));
  }
  if (h.kind == kAbort) {
    recv(fd, &h, sizeof(h), MSG_DONTWAIT);  // consume the header; the message follows
    int64_t origin = -1;
    return ReceiveAbort(fd, h, options.prev_name, &origin);
  }
  desc->seq = h.seq;
  desc->name_hash = h.name_hash;
  desc->shape_hash = h.shape_hash;
  desc->total_bytes = h.total_bytes;
  desc->shard_bytes = h.shard_bytes;
  desc->dtype = h.dtype;
  desc->op = h.op;
  desc->epoch = h.epoch;
  desc->postscale = h.postscale;
  std::memcpy(desc->name, h.name, kWireNameBytes);
  *started = true;
  return Status::Ok();
}

size_t ChunkBegin(size_t count, uint32_t size, uint32_t chunk) {
  return static_cast<size_t>((static_cast<unsigned __int128>(count) * chunk) / size);
}

uint32_t AllgatherOwnChunk(uint32_t rank, uint32_t size) { return (rank + 1) % size; }

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
