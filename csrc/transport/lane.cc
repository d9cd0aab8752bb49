// The lane transport (see lane.h for what it does and why). This file is the mechanics: one
// poll loop over the lane's 2·S sockets, non-blocking reads and writes, and the abort protocol.
//
// The loop. Each round polls every receive socket that has not seen its end marker and every send
// socket that has work (its frame in progress, a frame in the shared queue, or its end marker),
// then pumps the receive sockets first — if the next rank has gone, an abort frame explaining why
// may already be waiting on the receive side, and it is a better error than the broken send — and
// then the send sockets. A send socket keeps writing until the kernel refuses (MSG_DONTWAIT), each
// frame as one sendmsg of the header and payload iovecs; when its frame is out it takes the oldest
// frame of the shared queue if it has the smallest backlog of the lane's sockets (the bytes it
// holds that have not left: unsent in the kernel, SIOCOUTQNSD, plus what it has yet to write).
// Without that rule the first socket would take every frame while the kernel accepts (autotuned
// send buffers hold megabytes) and the other sockets' flows would idle; with it a step's frames
// spread over the sockets, in proportion to how fast each drains. Only sockets allowed to take a
// frame are polled for writing, so a socket refused does not spin. A receive socket keeps reading
// until the kernel has nothing: a header, then the payload straight into where the sink said.
//
// Aborting. SendAbort first finishes any half-written frame on a socket (so the stream stays
// framed), then writes an abort frame whose header carries the origin rank and code and whose
// payload is the message; best effort, bounded by two seconds. A rank does not send an abort back
// to the rank it came from (the next rank, when the abort has gone all the way round).
#include "transport/lane.h"

#include <linux/sockios.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cstring>

#include "common/clock.h"

namespace fasthorovod {
namespace {

constexpr uint32_t kFrameMagic = 0x46485652u;  // "FHVR"
enum FrameKind : uint16_t { kData = 1, kAbort = 2, kEnd = 3 };
constexpr uint32_t kEndRehash = 1;  // the sender replaces this connection after the collective (lane.h)

// The wire header. Internal to one build: every rank runs the same one.
struct FrameHeader {
  uint32_t magic;
  uint16_t kind;         // FrameKind
  uint16_t origin_code;  // abort: the Code of the failure where it started
  uint32_t origin_rank;  // the sender, or for an abort the rank where the failure started
  uint32_t step;
  uint32_t segment;
  uint32_t flags;        // end marker: kEndRehash
  uint64_t offset;  // bytes into the shard (end marker: the data frames sent on this socket)
  uint64_t length;  // payload bytes (abort: message bytes)
  CollectiveDesc desc;
};
static_assert(sizeof(FrameHeader) == kFrameHeaderBytes, "frame header is part of the wire format");

bool Retry(int err) { return err == EAGAIN || err == EWOULDBLOCK || err == EINTR; }

// Reads the message of an abort frame whose header `h` was just received on fd (its origin rank
// checked by AcceptHeader) and turns it into the origin's failure. At most kMaxAbortMessage bytes
// of it are read, whatever its length field says: the lane is failed anyway.
Status ReceiveAbort(int fd, const FrameHeader& h, const std::string& prev_name) {
  std::string message(std::min<uint64_t>(h.length, kMaxAbortMessage), '\0');
  if (!RecvAll(fd, message.data(), message.size(), Deadline::After(2.0), prev_name).ok()) {
    message = "(message lost)";
  }
  // A mismatch or a timeout is the same problem here; anything else is the origin's own failure.
  // The origin is named once, however many ranks forwarded its message.
  const std::string origin = Str(" [reported by rank ", h.origin_rank, "]");
  const bool named = message.size() >= origin.size() && message.compare(message.size() - origin.size(), origin.size(), origin) == 0;
  return Status::Error(CodeFromPeer(CodeFromWire(h.origin_code)), named ? message : message + origin);
}

}  // namespace

class Lane::Impl {
 public:
  Impl(RingLinks& links, const LaneOptions& opt) : links_(links), opt_(opt) {
    out_.resize(links.to_next.size());
    end_sent_.resize(links.to_next.size());
    frames_sent_.resize(links.to_next.size());
    backlog_.resize(links.to_next.size());
    in_.resize(links.from_prev.size());
  }

  void Begin(const CollectiveDesc& desc, uint64_t frames_out, uint64_t frames_in) {
    desc_ = &desc;
    for (auto& q : out_) q.clear();
    for (auto& in : in_) in = InState{};
    pending_.clear();
    end_sent_.assign(out_.size(), false);
    frames_sent_.assign(out_.size(), 0);
    frames_queued_ = 0;
    frames_out_ = frames_out;
    source_ = nullptr;
    source_done_ = false;
    recv_counted_ = frames_in != kFramesUnknown;
    recv_remaining_ = recv_counted_ ? frames_in : 0;
    abort_origin_ = -1;
    gate_open_ = !opt_.send_gate;
    rehash_in_ = 0;
    last_measure_ns_ = 0;
    dep_ = FrameDep::kOnRequest;
    dep_id_ = -1;
  }

  void Send(const Frame& frame, const char* payload) {
    pending_.push_back(MakeFrame(frame, payload));
    ++frames_queued_;
  }

  void Pull(FrameSource* source) {
    source_ = source;
    if (opt_.unsent_low_water <= 0) return;
    for (auto& sock : links_.to_next) {  // best effort: without it the kernel's buffer decides
      setsockopt(sock.fd(), IPPROTO_TCP, TCP_NOTSENT_LOWAT, &opt_.unsent_low_water, sizeof(opt_.unsent_low_water));
    }
  }

  Status Run(FrameSink* sink, LaneStats* stats) {
    sink_ = sink;
    Status st = frames_out_ == kFramesUnknown && source_ == nullptr
                    ? Status::Error(Code::kInvalidArgument, "a lane collective of unknown frames needs a FrameSource")
                    : Loop(stats);
    stats->rehash_in = rehash_in_;
    if (!st.ok()) {
      if (abort_origin_ < 0) abort_origin_ = static_cast<int64_t>(opt_.rank);
      if (static_cast<uint32_t>(abort_origin_) != Next()) SendAbort(st);
    }
    return st;
  }

 private:
  uint32_t Next() const { return (opt_.rank + opt_.distance) % opt_.size; }
  uint32_t Prev() const { return (opt_.rank + opt_.size - opt_.distance % opt_.size) % opt_.size; }
  struct OutFrame {
    FrameHeader header;
    const char* payload;
    size_t sent = 0;        // bytes of header + payload already written
    int64_t ready_ns = 0;   // observer: queued
    int64_t start_ns = 0;   // observer: first byte written
    int64_t dep_id = -1;
    FrameDep dep = FrameDep::kOnRequest;
    size_t total() const { return sizeof(FrameHeader) + header.length; }
  };

  struct InState {
    FrameHeader header;
    size_t header_got = 0;
    size_t payload_got = 0;
    char* payload_dst = nullptr;
    bool ended = false;     // this socket's end marker of the collective arrived
    uint64_t frames = 0;    // data frames received on this socket in the collective
    int64_t start_ns = 0;   // observer: first byte of the current frame
  };

  OutFrame MakeFrame(const Frame& frame, const char* payload) const {
    OutFrame f;
    f.header = FrameHeader{};
    FillHeader(&f.header, kData);
    f.header.step = frame.step;
    f.header.segment = frame.segment;
    f.header.offset = frame.offset;
    f.header.length = frame.length;
    f.payload = payload;
    if (opt_.observer != nullptr) {
      f.ready_ns = NowNs();
      f.dep_id = dep_id_;
      f.dep = dep_;
    }
    return f;
  }

  void FillHeader(FrameHeader* h, uint16_t kind) const {
    h->magic = kFrameMagic;
    h->kind = kind;
    h->origin_rank = opt_.rank;
    h->desc = *desc_;
  }

  Status Loop(LaneStats* stats) {
    std::vector<pollfd> fds(out_.size() + in_.size());
    int64_t last_progress = NowNs();
    const int64_t timeout_ns = static_cast<int64_t>(opt_.timeout_seconds * 1e9);
    while (ReceivesPending() || SendsPending()) {
      if (opt_.abort != nullptr && opt_.abort->load(std::memory_order_acquire) != 0) {
        const bool known = opt_.abort_reason != nullptr && opt_.abort_reason[0] != '\0';
        const Code code = opt_.abort_code != nullptr ? CodeFromWire(*opt_.abort_code) : Code::kAborted;
        return Status::Error(code, Str("rank ", opt_.rank, " aborted its collectives: ",
                                       known ? opt_.abort_reason : "the job is shutting down"));
      }
      if (!gate_open_) FHVD_RETURN_IF_ERROR(opt_.send_gate(&gate_open_));
      MeasureBacklogs();
      for (size_t s = 0; s < out_.size(); ++s) {
        fds[s] = {links_.to_next[s].fd(), static_cast<short>(SocketHasWork(s) ? POLLOUT : 0), 0};
      }
      for (size_t s = 0; s < in_.size(); ++s) {
        fds[out_.size() + s] = {links_.from_prev[s].fd(), static_cast<short>(in_[s].ended ? 0 : POLLIN), 0};
      }
      int rc = poll(fds.data(), fds.size(), gate_open_ ? 100 : 1);
      if (rc < 0 && errno != EINTR) return Status::Error(Code::kIoError, "poll(): " + ErrnoString(errno));
      bool progressed = false;
      // Receive first (see the top of this file).
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
            WaitingForData()
                ? Str("timed out after ", opt_.timeout_seconds, " s waiting for data from ", opt_.prev_name,
                      " (it may be stopped, dead, or running a different collective)")
                : Str("timed out after ", opt_.timeout_seconds, " s sending to ", opt_.next_name,
                      " (it is not reading: stopped or stuck)"));
      }
    }
    return Status::Ok();
  }

  // Socket s has something to write: its frame in progress, a frame from the shared queue it may
  // take, one to pull from the source, or (all frames out) its end marker.
  bool SocketHasWork(size_t s) const {
    if (!gate_open_) return false;
    return !out_[s].empty() || (!pending_.empty() && MayTake(s)) || (Pulling() && out_[s].empty()) ||
           (AllQueued() && !end_sent_[s]);
  }

  bool Pulling() const { return source_ != nullptr && !source_done_; }

  // Every data frame of the collective has been handed to some socket.
  bool AllQueued() const { return source_ != nullptr ? source_done_ && pending_.empty() : frames_queued_ == frames_out_; }

  // Each send socket's bytes not yet on the wire: unsent in the kernel and yet to be written; and,
  // with socket counters, the time since the last round added to the sockets that had a backlog.
  // Only queued frames are striped by it: a pulled collective's sockets take frames by their low
  // water, so without counters it measures nothing (two ioctls a round saved on the mesh).
  void MeasureBacklogs() {
    SocketCounters* counters = opt_.socket_counters;
    if ((out_.size() < 2 || source_ != nullptr) && counters == nullptr) return;
    const int64_t now = counters != nullptr ? NowNs() : 0;
    for (size_t s = 0; s < out_.size(); ++s) {
      if (counters != nullptr && last_measure_ns_ > 0 && backlog_[s] > 0) {
        counters[s].backlogged_ns.fetch_add(static_cast<uint64_t>(now - last_measure_ns_), std::memory_order_relaxed);
      }
      int unsent = 0;
      if (ioctl(links_.to_next[s].fd(), SIOCOUTQNSD, &unsent) < 0) unsent = 0;
      size_t backlog = static_cast<size_t>(std::max(unsent, 0));
      for (const OutFrame& f : out_[s]) backlog += f.total() - f.sent;
      backlog_[s] = backlog;
    }
    last_measure_ns_ = now;
  }

  // A socket takes a frame from the shared queue only if no other socket has less left to send.
  bool MayTake(size_t s) const {
    return out_.size() < 2 || backlog_[s] <= *std::min_element(backlog_.begin(), backlog_.end());
  }

  bool SendsPending() const {
    if (!gate_open_ || !pending_.empty()) return true;
    for (size_t s = 0; s < out_.size(); ++s) {
      if (SocketHasWork(s)) return true;
    }
    return false;
  }

  bool ReceivesPending() const { return recv_remaining_ > 0 || !AllEnded(); }

  // Data frames are still to come (not just end markers).
  bool WaitingForData() const { return recv_counted_ ? recv_remaining_ > 0 : !AllEnded(); }

  bool AllEnded() const {
    for (const auto& in : in_) {
      if (!in.ended) return false;
    }
    return true;
  }

  // Takes the socket's next frame: the oldest queued one (frames are queued in pipeline order), one
  // pulled from the source (at most one per PumpSend: the socket was writable below its low water
  // when the round began, maybe not after a whole frame), or its end marker once every frame of the
  // collective has been handed to some socket.
  bool TakeNext(size_t s, bool* pulled) {
    if (!pending_.empty()) {
      if (!MayTake(s)) return false;
      out_[s].push_back(pending_.front());
      pending_.pop_front();
      backlog_[s] += out_[s].back().total();
      frames_sent_[s]++;
      return true;
    }
    if (Pulling()) {
      if (*pulled) return false;
      Frame frame;
      const char* payload = nullptr;
      if (source_->Next(&frame, &payload)) {
        *pulled = true;
        out_[s].push_back(MakeFrame(frame, payload));
        ++frames_queued_;
        frames_sent_[s]++;
        return true;
      }
      source_done_ = true;
    }
    if (AllQueued() && !end_sent_[s]) {
      OutFrame f;
      f.header = FrameHeader{};
      FillHeader(&f.header, kEnd);
      f.header.offset = frames_sent_[s];
      if (s < 64 && (opt_.rehash_out >> s) & 1) f.header.flags = kEndRehash;
      f.payload = nullptr;
      out_[s].push_back(f);
      end_sent_[s] = true;
      return true;
    }
    return false;
  }

  Status PumpSend(size_t s, LaneStats* stats, bool* progressed) {
    auto& queue = out_[s];
    bool pulled = false;
    while (!queue.empty() || TakeNext(s, &pulled)) {
      OutFrame& f = queue.front();
      if (opt_.observer != nullptr && f.sent == 0) f.start_ns = NowNs();
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
        if (Retry(errno)) return Status::Ok();
        return Status::Error(Code::kIoError, Str("send to ", opt_.next_name, " failed: ", ErrnoString(errno),
                                                 " (peer died or closed the connection)"));
      }
      *progressed = true;
      f.sent += static_cast<size_t>(w);
      const bool marker = f.header.kind == kEnd;  // counted in no statistic, observed as no frame
      if (!marker) {
        stats->bytes_sent += static_cast<uint64_t>(w);
        if (opt_.socket_counters != nullptr) {
          opt_.socket_counters[s].bytes_sent.fetch_add(static_cast<uint64_t>(w), std::memory_order_relaxed);
        }
      }
      if (f.sent < f.total()) return Status::Ok();
      if (marker) {
        queue.pop_front();
        continue;
      }
      stats->frames_sent++;
      if (opt_.observer != nullptr) Observe(true, f.header, s, f.ready_ns, f.start_ns, f.dep, f.dep_id);
      queue.pop_front();
    }
    return Status::Ok();
  }

  Status PumpRecv(size_t s, LaneStats* stats, bool* progressed) {
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
                                                 desc_->seq, " (its proxy or worker died or failed)"));
      }
      if (r < 0) {
        if (Retry(errno)) return Status::Ok();
        return Status::Error(Code::kIoError, Str("receive from ", opt_.prev_name, " failed: ", ErrnoString(errno)));
      }
      if (opt_.observer != nullptr && in.header_got == 0) in.start_ns = NowNs();
      *progressed = true;
      if (in.header_got < sizeof(FrameHeader)) {
        in.header_got += static_cast<size_t>(r);
        if (in.header_got < sizeof(FrameHeader)) continue;
        FHVD_RETURN_IF_ERROR(AcceptHeader(s));
        if (in.header.kind == kAbort) {
          abort_origin_ = in.header.origin_rank;
          return ReceiveAbort(fd, in.header, opt_.prev_name);
        }
        if (in.header.kind == kEnd) {
          in.header_got = 0;
          in.ended = true;
          if (in.header.flags & kEndRehash) rehash_in_ |= uint64_t{1} << s;
          if (in.header.offset != in.frames) {
            return Status::Error(Code::kIoError, Str("protocol error from ", opt_.prev_name, ": collective #", desc_->seq,
                                                     " sent ", in.header.offset, " frames on socket ", s, ", ",
                                                     in.frames, " arrived"));
          }
          if (recv_remaining_ > 0 && AllEnded()) {
            return Status::Error(Code::kIoError, Str("protocol error from ", opt_.prev_name, ": collective #",
                                                     desc_->seq, " ended ", recv_remaining_, " frames early"));
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

  // Validates a complete header; for a data frame the sink says where its payload goes.
  Status AcceptHeader(size_t s) {
    InState& in = in_[s];
    const FrameHeader& h = in.header;
    if (h.magic != kFrameMagic) {
      return Status::Error(Code::kIoError, Str("corrupt frame from ", opt_.prev_name, " (bad magic)"));
    }
    if (h.kind == kAbort) {
      if (h.origin_rank >= opt_.size) {
        return Status::Error(Code::kIoError, Str("corrupt abort frame from ", opt_.prev_name, " (origin rank ",
                                                 h.origin_rank, " of ", opt_.size, " ranks)"));
      }
      return Status::Ok();
    }
    if (h.kind != kData && h.kind != kEnd) {
      return Status::Error(Code::kIoError, Str("corrupt frame from ", opt_.prev_name, " (unknown kind ", h.kind, ")"));
    }
    if (!SameCollective(h.desc, *desc_)) {
      abort_origin_ = opt_.rank;
      return Status::Error(Code::kMismatch, MismatchMessage(opt_.lane, opt_.rank, *desc_, Prev(), h.desc));
    }
    if (h.kind == kEnd) {
      if (h.length != 0) {  // an end marker has no payload; its length field would desynchronise the stream
        return Status::Error(Code::kIoError, Str("protocol error from ", opt_.prev_name, ": end marker of collective #",
                                                 desc_->seq, " with length field ", h.length, " (must be 0)"));
      }
      if ((h.flags & ~kEndRehash) != 0 || ((h.flags & kEndRehash) && s >= 64)) {
        return Status::Error(Code::kIoError, Str("protocol error from ", opt_.prev_name, ": end marker of collective #",
                                                 desc_->seq, " with flags ", h.flags));
      }
      return Status::Ok();
    }
    if (recv_counted_ && recv_remaining_ == 0) {
      return Status::Error(Code::kIoError, Str("protocol error from ", opt_.prev_name, ": more frames than collective #",
                                               desc_->seq, " has"));
    }
    in.payload_got = 0;
    Status st = sink_->Accept(FrameOf(h), s, &in.payload_dst);
    return st.ok() ? st : Status::Error(st.code(), Str("protocol error from ", opt_.prev_name, ": ", st.message()));
  }

  void FinishFrame(size_t s) {
    InState& in = in_[s];
    const Frame frame = FrameOf(in.header);
    if (opt_.observer != nullptr) {
      dep_id_ = Observe(false, in.header, s, in.start_ns, in.start_ns, FrameDep::kOnPeerSend, -1);
      dep_ = FrameDep::kOnReceive;
    }
    in.header_got = 0;
    in.frames++;
    if (recv_counted_) recv_remaining_--;
    sink_->Received(frame, s);  // may queue sends, which depend on this receive
  }

  static Frame FrameOf(const FrameHeader& h) {
    Frame f;
    f.step = h.step;
    f.segment = h.segment;
    f.offset = h.offset;
    f.length = h.length;
    return f;
  }

  int64_t Observe(bool send, const FrameHeader& h, size_t socket, int64_t ready_ns, int64_t start_ns, FrameDep dep,
                  int64_t dep_id) {
    FrameEvent e;
    e.send = send;
    e.src = send ? opt_.rank : Prev();
    e.dst = send ? Next() : opt_.rank;
    e.lane = opt_.lane;
    e.socket = socket;
    e.frame = FrameOf(h);
    e.ready_ns = ready_ns;
    e.start_ns = start_ns;
    e.end_ns = NowNs();
    e.dep = dep;
    e.dep_id = dep_id;
    return opt_.observer->OnFrame(*desc_, e);
  }

  // The send side broke: give the receive side a short chance to deliver an abort frame (the
  // reason the next rank went away, when it is also the previous rank or the abort went round).
  Status ReadPendingAbort() {
    std::vector<pollfd> fds;
    for (auto& sock : links_.from_prev) fds.push_back({sock.fd(), POLLIN, 0});
    LaneStats ignored;
    bool progressed = false;
    Deadline deadline = Deadline::After(0.2);
    while (!deadline.Expired() && poll(fds.data(), fds.size(), deadline.RemainingMs(50)) > 0) {
      for (size_t s = 0; s < in_.size(); ++s) {
        if (fds[s].revents != 0) FHVD_RETURN_IF_ERROR(PumpRecv(s, &ignored, &progressed));
      }
    }
    return Status::Ok();
  }

  // Tells the next rank why this lane failed (see the top of this file). Best effort, bounded.
  void SendAbort(const Status& failure) {
    std::string text = failure.message().substr(0, kMaxAbortMessage);
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
      FrameHeader h{};
      FillHeader(&h, kAbort);
      h.origin_rank = static_cast<uint32_t>(abort_origin_);
      h.origin_code = static_cast<uint16_t>(failure.code());
      h.length = text.size();
      if (SendAll(fd, &h, sizeof(h), deadline, opt_.next_name).ok()) {
        SendAll(fd, text.data(), text.size(), deadline, opt_.next_name);
      }
    }
  }

  RingLinks& links_;
  const LaneOptions opt_;  // a copy: the lane may outlive the caller's options
  const CollectiveDesc* desc_ = nullptr;
  FrameSink* sink_ = nullptr;
  std::vector<std::deque<OutFrame>> out_;
  std::vector<InState> in_;
  std::deque<OutFrame> pending_;  // frames ready to send, in the order queued, not yet on a socket
  std::vector<bool> end_sent_;    // per socket: its end marker has been queued
  std::vector<uint64_t> frames_sent_;  // per socket: data frames it took in this collective (its end marker says)
  FrameSource* source_ = nullptr;  // Pull's, for this collective
  bool source_done_ = false;       // it has no frame left
  bool recv_counted_ = true;       // frames_in was known (else: until every end marker)
  bool gate_open_ = true;         // LaneOptions::send_gate said open (or there is none)
  std::vector<size_t> backlog_;   // per send socket (S > 1 or counters): bytes not yet on the wire, this poll round
  int64_t last_measure_ns_ = 0;   // when backlog_ was measured (counters only; 0: not yet in this collective)
  uint64_t rehash_in_ = 0;        // receive sockets whose end marker announced a replacement
  uint64_t frames_queued_ = 0;    // frames queued so far in this collective
  uint64_t frames_out_ = 0;       // frames this rank sends in the whole collective (or kFramesUnknown)
  uint64_t recv_remaining_ = 0;
  int64_t abort_origin_ = -1;
  FrameDep dep_ = FrameDep::kOnRequest;  // what a frame queued now depends on (observer only)
  int64_t dep_id_ = -1;
};

Lane::Lane(RingLinks& links, const LaneOptions& options) : impl_(new Impl(links, options)) {}
Lane::~Lane() { delete impl_; }
void Lane::Begin(const CollectiveDesc& desc, uint64_t frames_out, uint64_t frames_in) {
  impl_->Begin(desc, frames_out, frames_in);
}
void Lane::Send(const Frame& frame, const char* payload) { impl_->Send(frame, payload); }
void Lane::Pull(FrameSource* source) { impl_->Pull(source); }
Status Lane::Run(FrameSink* sink, LaneStats* stats) { return impl_->Run(sink, stats); }


void DrainIncoming(RingLinks& links, double seconds) {
  std::vector<char> scratch(1 << 16);
  Deadline deadline = Deadline::After(seconds);
  for (auto& sock : links.from_prev) {
    while (sock.valid() && !deadline.Expired()) {
      pollfd p{sock.fd(), POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) break;
      if (recv(sock.fd(), scratch.data(), scratch.size(), MSG_DONTWAIT) <= 0) break;
    }
  }
}

}  // namespace fasthorovod
