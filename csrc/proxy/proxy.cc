// The proxy loop: shared-memory request → this lane's shard through the ring → completion.
//
// A proxy is a plain OS process started by its worker (python -m fasthorovod.proxy) for one lane.
// It owns that lane's TCP connections and nothing else; all it knows about a request is in the
// request slot (which buffer, which elements are this lane's shard, dtype, scale factors); the
// buffers themselves arrive as memfds on the socket it inherited from the worker (shm/handoff.h).
// It exits when the worker sets `stop`, and also when the worker process dies, whichever of its
// threads spawned the proxy: a WorkerWatch (proxy/watch.h) raises the abort flag at once, the
// loops below notice within 100 ms, and the sockets close, so the neighbouring proxies fail their
// collectives at once instead of waiting for a timeout. Nothing is left to clean up after the
// worker: its segments have no names.
//
// Requests arrive in the order the ranks negotiated (csrc/negotiation), the same on every rank,
// so a proxy simply runs them one after the other. hvd.join() needs nothing here: a joined rank's
// worker posts the collectives the others run, with a zero buffer (kRequestZeroFill).
#include "proxy/proxy.h"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "collectives/ring.h"
#include "proxy/watch.h"
#include "shm/channel.h"
#include "shm/handoff.h"
#include "shm/segment.h"
#include "trace/frame_trace.h"
#include "trace/recorder.h"
#include "transport/lane.h"
#include "transport/socket.h"

namespace fasthorovod {
namespace {

std::atomic<uint32_t> g_signalled{0};
ChannelHeader* g_channel = nullptr;

constexpr char kWorkerGone[] = "its worker process died or was terminated";

// Async-signal-safe: plain stores only.
void OnTerminate(int) {
  g_signalled.store(1);
  if (g_channel != nullptr && g_channel->abort.load() == 0) {
    for (size_t i = 0; i < sizeof(kWorkerGone); ++i) g_channel->abort_reason[i] = kWorkerGone[i];
    g_channel->abort_code = static_cast<uint32_t>(Code::kAborted);
    g_channel->abort.store(1);
  }
}

// The worker process is gone (WorkerWatch): stop as a SIGTERM would, and wake the loops.
void OnWorkerDeath() {
  OnTerminate(0);
  if (g_channel != nullptr) {
    FutexWakeAll(&g_channel->head);
    FutexWakeAll(&g_channel->go);
  }
}

void InstallSignalHandlers() {
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_handler = OnTerminate;
  sigaction(SIGTERM, &sa, nullptr);
  // SIGHUP also arrives (with SIGCONT) when the worker died while this proxy was stopped: the
  // proxy is alone in its process group, which the worker's death orphans.
  sigaction(SIGHUP, &sa, nullptr);
  // Ctrl-C reaches the whole process group; the worker decides what happens, not the proxy.
  signal(SIGINT, SIG_IGN);
  signal(SIGPIPE, SIG_IGN);
}

class Proxy {
 public:
  Proxy(ChannelHeader* channel, uint32_t lane, int segments)
      : ch_(channel), lane_(lane), info_(channel->lanes[lane]), segments_(segments) {}

  Status Run() {
    Status st = Serve();
    trace_.Close();
    if (!st.ok()) Fail(st);
    // Keeps an abort frame just sent from being reset away (lane.h); an orderly stop sent none,
    // and does not wait for the neighbours.
    if (!st.ok() || !dead_.ok()) DrainIncoming(links_, 1.0);
    info_.state.store(static_cast<uint32_t>(st.ok() ? LaneState::kExited : LaneState::kFailed));
    FutexWakeAll(&ch_->head);
    return st;
  }

 private:
  bool Stopping() const {
    return g_signalled.load() != 0 || ch_->stop.load() != 0 || getppid() != ch_->worker_pid;
  }

  std::string Who(uint32_t rank) const { return Str("rank ", rank, " lane ", lane_); }

  Status Serve() {
    Socket listener;
    int port = 0;
    FHVD_RETURN_IF_ERROR(Listen(ch_->bind_host, ch_->socket_buffer_bytes, &listener, &port));
    info_.listen_port = port;
    info_.pid = getpid();
    info_.state.store(static_cast<uint32_t>(LaneState::kListening));

    // Wait for the worker to exchange addresses with the other ranks.
    Deadline deadline = Deadline::After(ch_->timeout_seconds);
    while (ch_->go.load(std::memory_order_acquire) == 0) {
      if (Stopping()) return Status::Ok();
      if (deadline.Expired()) return Status::Error(Code::kTimeout, "timed out waiting for the worker's go");
      FutexWait(&ch_->go, 0, 100);
    }
    LinkIdentity self;
    std::memcpy(self.token, ch_->token, kTokenBytes);
    self.rank = ch_->rank;
    self.size = ch_->size;
    self.lane = lane_;
    self.config_hash = ch_->config_hash;
    RingEndpoint next{info_.next_host, info_.next_port};
    FHVD_RETURN_IF_ERROR(EstablishRing(self, listener, next, static_cast<int>(ch_->sockets_per_lane),
                                       ch_->socket_buffer_bytes, Deadline::After(ch_->timeout_seconds), &links_));
    listener.Close();  // no more connections are accepted: strangers get a refusal from the kernel
    info_.state.store(static_cast<uint32_t>(LaneState::kConnected));
    info_.progress_ns.store(NowNs());

    options_.rank = ch_->rank;
    options_.size = ch_->size;
    options_.lane = lane_;
    options_.segment_bytes = ch_->segment_bytes;
    options_.timeout_seconds = ch_->timeout_seconds;
    options_.abort = &ch_->abort;
    options_.abort_reason = ch_->abort_reason;
    options_.abort_code = &ch_->abort_code;
    options_.progress_ns = &info_.progress_ns;
    options_.prev_name = Who((ch_->rank + ch_->size - 1) % ch_->size);
    options_.next_name = Str(Who((ch_->rank + 1) % ch_->size), " (", next.host, ":", next.port, ")");

    uint32_t next_request = 0;
    for (;;) {
      if (Stopping()) return Status::Ok();
      SyncTrace();
      if (ch_->head.load(std::memory_order_acquire) != next_request) {
        Handle(ch_->slots[next_request % kNumSlots]);
        ++next_request;
      } else {
        (void)ReceiveSegments(0);  // takes new buffers while idle (bounds descriptors in flight)
        FutexWait(&ch_->head, next_request, 100);
      }
    }
  }

  // Applies a trace start/stop the worker posted (ProxyChannel::SetTrace) and acks it.
  void SyncTrace() {
    const uint32_t gen = ch_->trace_generation.load(std::memory_order_acquire);
    if (gen == trace_generation_) return;
    trace_generation_ = gen;
    trace_.Close();
    if (ch_->trace_dir[0] != '\0') {
      TraceOptions o;
      o.dir = std::string(ch_->trace_dir, strnlen(ch_->trace_dir, kTraceDirBytes));
      o.rank = ch_->rank;
      o.size = ch_->size;
      o.lane = lane_;
      o.clock_offset_ns = ch_->trace_clock_offset_ns;
      o.extra_json = Str("\"sockets\": ", ch_->sockets_per_lane, ", \"segment_bytes\": ", ch_->segment_bytes);
      Status st = trace_.Open(o);
      if (!st.ok()) std::fprintf(stderr, "[fasthorovod proxy lane %u] trace off: %s\n", lane_, st.message().c_str());
    }
    options_.observer = trace_.active() ? &trace_observer_ : nullptr;
    info_.trace_ack.store(gen, std::memory_order_release);
  }

  void Handle(RequestSlot& slot) {
    Status st = dead_;
    if (st.ok()) st = Execute(slot.desc);
    if (!st.ok()) {
      if (dead_.ok()) dead_ = Status::Error(st.code(), Str("lane ", lane_, " is down after an earlier failure: ", st.message()));
      uint32_t expected = 0;
      if (slot.failed.compare_exchange_strong(expected, 1)) {
        slot.error_code = static_cast<uint32_t>(st.code());
        CopyString(slot.error, Str("rank ", ch_->rank, " lane ", lane_, ": ", st.message()));
      }
      Fail(st);
    }
    info_.progress_ns.store(NowNs());
    slot.lanes_done.fetch_add(1, std::memory_order_acq_rel);
    FutexWakeAll(&slot.lanes_done);
  }

  Status Execute(const RequestDesc& r) {
    if (r.kind != static_cast<uint32_t>(RequestKind::kAllreduce) || !DTypeValid(r.dtype) ||
        r.op > static_cast<uint32_t>(ReduceOp::kBroadcast)) {
      return Status::Error(Code::kInvalidArgument, "malformed request");
    }
    const DType dtype = static_cast<DType>(r.dtype);
    const size_t elem = DTypeSize(dtype);
    ShmSegment* buffer = nullptr;
    FHVD_RETURN_IF_ERROR(MapBuffer(r.buffer_id, &buffer));
    if (r.buffer_offset + r.count * elem > buffer->size()) {
      return Status::Error(Code::kInvalidArgument, "request exceeds its data buffer");
    }
    const uint64_t begin = r.lane_begin[lane_];
    const uint64_t end = r.lane_begin[lane_ + 1];
    if (begin > end || end > r.count) return Status::Error(Code::kInvalidArgument, "bad lane boundaries");

    CollectiveDesc desc;
    desc.seq = collective_seq_++;
    desc.postscale = r.postscale;
    desc.name_hash = r.name_hash;
    desc.shape_hash = r.shape_hash;
    desc.total_bytes = r.count * elem;
    desc.shard_bytes = (end - begin) * elem;
    desc.dtype = r.dtype;
    desc.op = r.op;
    std::strncpy(desc.name, r.name, kWireNameBytes - 1);

    ShardWork work;
    work.data = static_cast<char*>(buffer->data()) + r.buffer_offset + begin * elem;
    work.count = end - begin;
    work.dtype = dtype;
    work.prescale = r.prescale;
    work.postscale = r.postscale;

    RingStats stats;
    const bool zero_fill = (r.flags & kRequestZeroFill) != 0;  // a joined rank's part (negotiation/member.h)
    trace_observer_.SetCollective(zero_fill ? kNoRequest : r.trace_id, zero_fill ? kTraceFlagZeroFill : 0);
    if (zero_fill) info_.zero_filled.fetch_add(1, std::memory_order_relaxed);
    Status st = RingAllreduce(links_, desc, work, options_, &stats);
    info_.bytes_sent.fetch_add(stats.bytes_sent, std::memory_order_relaxed);
    info_.bytes_received.fetch_add(stats.bytes_received, std::memory_order_relaxed);
    info_.busy_ns.fetch_add(static_cast<uint64_t>(stats.end_ns - stats.start_ns), std::memory_order_relaxed);
    info_.collectives.fetch_add(1, std::memory_order_relaxed);
    return st;
  }

  // The worker hands every buffer over before it posts a request naming it, so an unknown id
  // is already queued on the socket (or the worker is gone).
  Status MapBuffer(uint32_t id, ShmSegment** out) {
    const Deadline deadline = Deadline::After(ch_->timeout_seconds);
    auto it = buffers_.find(id);
    while (it == buffers_.end()) {
      if (Stopping()) return Status::Error(Code::kAborted, "stopping");
      if (deadline.Expired()) {
        return Status::Error(Code::kTimeout, Str("the worker never handed over data buffer ", id));
      }
      FHVD_RETURN_IF_ERROR(ReceiveSegments(100));
      it = buffers_.find(id);
    }
    *out = &it->second;
    return Status::Ok();
  }

  // Maps every buffer queued on the worker's socket, waiting up to timeout_ms for the first.
  Status ReceiveSegments(int timeout_ms) {
    while (!segments_closed_) {
      SegmentGrant grant;
      Status st = ReceiveSegment(segments_, timeout_ms, &grant);
      if (st.code() == Code::kAborted) segments_closed_ = true;  // the worker closed the channel
      if (!st.ok() || grant.fd < 0) return st;
      ShmSegment seg;
      FHVD_RETURN_IF_ERROR(ShmSegment::Map(grant.fd, grant.bytes, Str("data buffer ", grant.id), &seg));
      buffers_[grant.id] = std::move(seg);
      timeout_ms = 0;
    }
    return Status::Error(Code::kAborted, "the worker closed the channel");
  }

  void Fail(const Status& st) {
    if (info_.state.load() != static_cast<uint32_t>(LaneState::kFailed)) {
      info_.error_code = static_cast<uint32_t>(st.code());
      CopyString(info_.error, st.message());
      info_.state.store(static_cast<uint32_t>(LaneState::kFailed));
    }
  }

  ChannelHeader* ch_;
  const uint32_t lane_;
  LaneInfo& info_;
  const int segments_;  // the socket the worker hands buffers over (shm/handoff.h)
  bool segments_closed_ = false;
  RingLinks links_;
  RingOptions options_;
  std::unordered_map<uint32_t, ShmSegment> buffers_;
  Status dead_;
  uint64_t collective_seq_ = 0;  // collectives this lane has run
  TraceRecorder trace_;
  TraceFrameObserver trace_observer_{&trace_};
  uint32_t trace_generation_ = 0;
};

}  // namespace

Status RunProxy(int segments, uint32_t lane) {
  InstallSignalHandlers();
  SegmentGrant grant;
  FHVD_RETURN_IF_ERROR(ReceiveSegment(segments, 10000, &grant));
  if (grant.fd < 0 || grant.id != kChannelSegment) {
    if (grant.fd >= 0) close(grant.fd);
    return Status::Error(Code::kInvalidArgument, "the worker did not hand over its channel");
  }
  ShmSegment segment;
  FHVD_RETURN_IF_ERROR(ShmSegment::Map(grant.fd, grant.bytes, "the proxy channel", &segment));
  if (segment.size() < sizeof(ChannelHeader)) return Status::Error(Code::kInvalidArgument, "channel segment too small");
  auto* channel = static_cast<ChannelHeader*>(segment.data());
  if (channel->magic != kChannelMagic || channel->version != kChannelVersion) {
    return Status::Error(Code::kInvalidArgument, "channel segment has a different version (stale build?)");
  }
  if (lane >= channel->num_lanes) return Status::Error(Code::kInvalidArgument, Str("lane ", lane, " out of range"));
  g_channel = channel;
  Status st;
  {
    WorkerWatch watch;
    st = watch.Start(channel->worker_pid, OnWorkerDeath);
    if (st.ok()) {
      Proxy proxy(channel, lane, segments);
      st = proxy.Run();
    }
  }  // the watch's thread has stopped here
  g_channel = nullptr;
  return st;
}

}  // namespace fasthorovod
