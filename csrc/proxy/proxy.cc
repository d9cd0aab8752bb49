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
#include <sys/types.h>
#include <unistd.h>

#include <cstdio>
#include <cerrno>
#include <cstring>
#include <map>
#include <unordered_map>
#include <vector>

#include "collectives/alltoall.h"
#include "collectives/ring.h"
#include "proxy/watch.h"
#include "shm/channel.h"
#include "shm/handoff.h"
#include "shm/host.h"
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

  bool Hierarchical() const { return ch_->local_size > 1; }
  // A ring neighbour: a rank, or with the hierarchical allreduce a host's local rank like this one.
  std::string Who(uint32_t ring_rank) const {
    return Hierarchical() ? Str("host ", ring_rank, " local rank ", ch_->local_rank, " lane ", lane_)
                          : Str("rank ", ring_rank, " lane ", lane_);
  }

  Status Serve() {
    int port = 0;
    FHVD_RETURN_IF_ERROR(Listen(ch_->bind_host, ch_->socket_buffer_bytes, &listener_, &port));
    info_.listen_port = port;
    FHVD_RETURN_IF_ERROR(Listen(ch_->bind_host, ch_->socket_buffer_bytes, &alt_listener_, &port));
    info_.alt_listen_port = port;
    if (ch_->size > 1 && ch_->size <= kMaxMeshRanks) {  // the alltoall's; connected at the first one
      FHVD_RETURN_IF_ERROR(Listen(ch_->bind_host, ch_->socket_buffer_bytes, &mesh_listener_, &port));
      info_.mesh_port = port;
    }
    info_.pid = getpid();
    info_.state.store(static_cast<uint32_t>(LaneState::kListening));

    // Wait for the worker to exchange addresses with the other ranks.
    Deadline deadline = Deadline::After(ch_->timeout_seconds);
    while (ch_->go.load(std::memory_order_acquire) == 0) {
      if (Stopping()) return Status::Ok();
      if (deadline.Expired()) return Status::Error(Code::kTimeout, "timed out waiting for the worker's go");
      FutexWait(&ch_->go, 0, 100);
    }
    // The ring: every rank, or with the hierarchical allreduce this local rank of every host.
    uint32_t ring_rank = ch_->rank, ring_size = ch_->size;
    if (Hierarchical()) {
      FHVD_RETURN_IF_ERROR(ReceiveHost());
      ring_rank = ch_->host_index;
      ring_size = ch_->num_hosts;
    }
    next_ = RingEndpoint{info_.next_host, {info_.next_port}};
    if (info_.next_alt_port != 0) next_.ports.push_back(info_.next_alt_port);
    const RingEndpoint& next = next_;
    if (ring_size > 1) {
      // The rings of different local ranks join different proxies: a connection to the wrong one
      // fails the handshake.
      const uint64_t local = Hierarchical() ? 0x9e3779b97f4a7c15ull * (uint64_t{ch_->local_rank} + 1) : 0;
      self_ = Identity(ring_rank, ring_size, ch_->config_hash ^ local);
      FHVD_RETURN_IF_ERROR(EstablishRing(self_, {listener_, alt_listener_}, next, static_cast<int>(ch_->sockets_per_lane),
                                         ch_->socket_buffer_bytes, Deadline::After(ch_->timeout_seconds), &links_));
      options_.socket_counters = info_.sockets;
    } else {
      listener_.Close();  // nothing will ever connect
      alt_listener_.Close();
    }
    // With a ring the listeners stay open for re-hashed connections (ConnectRingSockets); what
    // connects meanwhile waits in the kernel's backlog until then, and only a connection that
    // proves the job token and is expected is taken.
    info_.state.store(static_cast<uint32_t>(LaneState::kConnected));
    info_.progress_ns.store(NowNs());

    options_.rank = ring_rank;
    options_.size = ring_size;
    options_.lane = lane_;
    options_.segment_bytes = ch_->segment_bytes;
    options_.timeout_seconds = ch_->timeout_seconds;
    options_.abort = &ch_->abort;
    options_.abort_reason = ch_->abort_reason;
    options_.abort_code = &ch_->abort_code;
    options_.progress_ns = &info_.progress_ns;
    options_.prev_name = Who((ring_rank + ring_size - 1) % ring_size);
    options_.next_name = Str(Who((ring_rank + 1) % ring_size), " (", next.host, ":", next.ports[0], ")");

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
      uint32_t expected = 0;
      if (slot.failed.compare_exchange_strong(expected, 1)) {
        slot.error_code = static_cast<uint32_t>(st.code());
        CopyString(slot.error, Str("rank ", ch_->rank, " lane ", lane_, ": ", st.message()));
      }
      GoDown(st);
    }
    info_.progress_ns.store(NowNs());
    slot.lanes_done.fetch_add(1, std::memory_order_acq_rel);
    FutexWakeAll(&slot.lanes_done);
    // Connections announced in this collective are replaced once its result is out, while the
    // worker takes it; a failure leaves the lane down, and the next request says why.
    if ((rehash_out_ | rehash_in_) != 0) {
      Status replaced = Rehash(rehash_out_, rehash_in_);
      rehash_out_ = rehash_in_ = 0;
      if (!replaced.ok()) GoDown(replaced);
    }
  }

  // The lane is unusable from here on: later requests fail with why, the worker sees the lane
  // failed, and with the hierarchical allreduce the host's other proxies are told.
  void GoDown(const Status& st) {
    if (dead_.ok()) dead_ = Status::Error(st.code(), Str("lane ", lane_, " is down after an earlier failure: ", st.message()));
    Fail(st);
    if (host_.attached()) AbortHost(Status::Error(st.code(), Str("rank ", ch_->rank, " lane ", lane_, ": ", st.message())));
  }

  Status Execute(const RequestDesc& r) {
    if (r.kind != static_cast<uint32_t>(RequestKind::kAllreduce) || !DTypeValid(r.dtype) ||
        r.op > static_cast<uint32_t>(ReduceOp::kAlltoall)) {
      return Status::Error(Code::kInvalidArgument, "malformed request");
    }
    if (r.op == static_cast<uint32_t>(ReduceOp::kAlltoall)) return ExecuteAlltoall(r);
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

    const CollectiveDesc desc = NextDesc(r, elem, end - begin);
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
    options_.rehash_out = info_.rehash_request.exchange(0, std::memory_order_acq_rel) & SocketMask();
    Status st = Hierarchical() ? ExecuteHost(r, desc, work, &stats) : RingAllreduce(links_, desc, work, options_, &stats);
    if (st.ok()) {
      rehash_out_ = options_.rehash_out;
      rehash_in_ = stats.rehash_in;
    }
    options_.rehash_out = 0;
    info_.bytes_sent.fetch_add(stats.bytes_sent, std::memory_order_relaxed);
    info_.bytes_received.fetch_add(stats.bytes_received, std::memory_order_relaxed);
    info_.busy_ns.fetch_add(static_cast<uint64_t>(stats.end_ns - stats.start_ns), std::memory_order_relaxed);
    info_.collectives.fetch_add(1, std::memory_order_relaxed);
    return st;
  }

  // What this lane proves to the peers it connects to, as rank `rank` of `size`.
  LinkIdentity Identity(uint32_t rank, uint32_t size, uint64_t config_hash) const {
    LinkIdentity self;
    std::memcpy(self.token, ch_->token, kTokenBytes);
    self.rank = rank;
    self.size = size;
    self.lane = lane_;
    self.config_hash = config_hash;
    return self;
  }

  // This lane's description of request `r` (its next collective): what every frame carries and
  // the peers compare (common/collective.h). `shard` is this lane's elements of it.
  CollectiveDesc NextDesc(const RequestDesc& r, size_t elem, uint64_t shard) {
    CollectiveDesc desc;
    desc.seq = collective_seq_++;
    desc.postscale = r.postscale;
    desc.name_hash = r.name_hash;
    desc.shape_hash = r.shape_hash;
    desc.total_bytes = r.count * elem;
    desc.shard_bytes = shard * elem;
    desc.dtype = r.dtype;
    desc.op = r.op;
    std::strncpy(desc.name, r.name, kWireNameBytes - 1);
    return desc;
  }

  // -- the alltoall (collectives/alltoall.h) -----------------------------------------------------

  Status ExecuteAlltoall(const RequestDesc& r) {
    const uint32_t n = ch_->size;
    if (n < 2 || ch_->mesh_size != n) {
      return Status::Error(Code::kInvalidArgument, Str("an alltoall runs on the mesh of 2 to ", kMaxMeshRanks, " ranks"));
    }
    if ((r.flags & kRequestZeroFill) != 0) {
      return Status::Error(Code::kInvalidArgument, "Alltoall is not supported with Join at this time.");
    }
    ShmSegment* buffer = nullptr;
    FHVD_RETURN_IF_ERROR(MapBuffer(r.buffer_id, &buffer));
    const size_t elem = DTypeSize(static_cast<DType>(r.dtype));
    const size_t send_offset = AlltoallSendOffset(n);
    if (r.buffer_offset > buffer->size() || buffer->size() - r.buffer_offset < send_offset) {
      return Status::Error(Code::kInvalidArgument, "alltoall request exceeds its data buffer (size table)");
    }
    char* base = static_cast<char*>(buffer->data()) + r.buffer_offset;
    std::vector<uint64_t> table(AlltoallTableWords(n));
    std::memcpy(table.data(), base, table.size() * sizeof(uint64_t));
    AlltoallWork work;
    work.send_count.assign(table.begin(), table.begin() + n);
    work.recv_count.assign(table.begin() + n, table.begin() + 2 * n);
    ShmSegment* recv_buffer = nullptr;
    if (table[2 * n] > UINT32_MAX) return Status::Error(Code::kInvalidArgument, "alltoall receive buffer id out of range");
    FHVD_RETURN_IF_ERROR(MapBuffer(static_cast<uint32_t>(table[2 * n]), &recv_buffer));
    // Every count bounded first, so that the sums below cannot wrap.
    uint64_t sent = 0, received = 0;
    for (uint32_t i = 0; i < n; ++i) {
      if (work.send_count[i] > buffer->size() / elem || work.recv_count[i] > recv_buffer->size() / elem) {
        return Status::Error(Code::kInvalidArgument, "alltoall size table exceeds its data buffers");
      }
      sent += work.send_count[i];
      received += work.recv_count[i];
    }
    const uint64_t recv_offset = table[2 * n + 1];
    if (sent > (buffer->size() - r.buffer_offset - send_offset) / elem || recv_offset > recv_buffer->size() ||
        received > (recv_buffer->size() - recv_offset) / elem) {
      return Status::Error(Code::kInvalidArgument, "alltoall request exceeds its data buffers");
    }
    work.send = base + send_offset;
    if (r.buffer_offset % alignof(uint64_t) != 0) return Status::Error(Code::kInvalidArgument, "alltoall size table misaligned");
    work.staged = reinterpret_cast<const uint64_t*>(base) + AlltoallStagedWord(n);  // the worker may still be staging
    work.claimed = reinterpret_cast<uint64_t*>(base) + AlltoallClaimWord(n);  // shared with the rank's other lanes
    work.recv = static_cast<char*>(recv_buffer->data()) + recv_offset;
    work.dtype = static_cast<DType>(r.dtype);
    work.lanes = ch_->num_lanes;
    work.lane = lane_;
    if (mesh_.empty()) {
      std::vector<RingEndpoint> peers(n);
      for (uint32_t i = 0; i < n; ++i) {
        peers[i] = RingEndpoint{std::string(ch_->mesh_hosts[i], strnlen(ch_->mesh_hosts[i], kHostBytes)),
                                {ch_->mesh_ports[i][lane_]}};
      }
      // The mesh joins every rank's lane j, whatever the layout: its identity is the job's rank (a
      // hierarchical ring's is the host's place among the hosts).
      info_.progress_ns.store(NowNs());
      Status meshed = EstablishMesh(Identity(ch_->rank, n, ch_->config_hash), mesh_listener_, peers,
                                    static_cast<int>(ch_->sockets_per_lane), ch_->socket_buffer_bytes,
                                    Deadline::After(ch_->timeout_seconds), &mesh_, &ch_->abort);
      // Stopped by the job's abort: its reason names the rank that failed, where the set-up's own
      // message could only say that it stopped.
      if (meshed.code() == Code::kAborted && ch_->abort.load() != 0) meshed = JobAbort();
      FHVD_RETURN_IF_ERROR(meshed.WithContext("connecting the alltoall mesh: "));
      info_.progress_ns.store(NowNs());
    }
    const CollectiveDesc desc = NextDesc(r, elem, r.lane_begin[lane_ + 1] - r.lane_begin[lane_]);
    trace_observer_.SetCollective(r.trace_id, 0);
    RingOptions options = options_;  // the ring's, but for the place among all ranks (a hierarchical
    options.rank = ch_->rank;        // ring's is the host's among the hosts)
    options.size = n;
    RingStats stats;
    Status st = MeshAlltoall(mesh_, desc, work, options, &stats);
    info_.mesh_bytes_sent.fetch_add(stats.bytes_sent, std::memory_order_relaxed);
    info_.mesh_bytes_received.fetch_add(stats.bytes_received, std::memory_order_relaxed);
    info_.collectives.fetch_add(1, std::memory_order_relaxed);
    return st;
  }

  // The job's abort (its flag is up), with its code and reason.
  Status JobAbort() const {
    return Status::Error(CodeFromWire(ch_->abort_code), std::string(ch_->abort_reason, strnlen(ch_->abort_reason, kErrorBytes)));
  }

  uint64_t SocketMask() const {
    if (links_.to_next.empty()) return 0;
    return links_.to_next.size() >= 64 ? ~uint64_t{0} : (uint64_t{1} << links_.to_next.size()) - 1;
  }

  // Replaces the send sockets this lane announced in the collective that just ended and the
  // receive sockets the previous rank announced (transport/lane.h): new connections, so new
  // source ports and the next rank's other destination port (RingEndpoint), so new hashes onto
  // the network's per-flow caps and paths.
  Status Rehash(uint64_t out_mask, uint64_t in_mask) {
    std::vector<uint32_t> out, in;
    for (uint32_t s = 0; s < links_.to_next.size() && s < 64; ++s) {
      if ((out_mask >> s) & 1) out.push_back(s);
      if ((in_mask >> s) & 1) in.push_back(s);
    }
    const int64_t start = NowNs();
    Status st = ConnectRingSockets(self_, {listener_, alt_listener_}, next_, out, in, static_cast<int>(links_.to_next.size()),
                                   ch_->socket_buffer_bytes, Deadline::After(ch_->timeout_seconds), &links_);
    if (!st.ok()) return st.WithContext("re-hashing the lane's connections: ");
    info_.rehashes.fetch_add(out.size(), std::memory_order_relaxed);
    info_.rehash_ns.fetch_add(static_cast<uint64_t>(NowNs() - start), std::memory_order_relaxed);
    return Status::Ok();
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
      if (grant.id == kHostSegment) {
        FHVD_RETURN_IF_ERROR(HostSegment::Map(grant.fd, grant.bytes, &host_));
      } else {
        ShmSegment seg;
        FHVD_RETURN_IF_ERROR(ShmSegment::Map(grant.fd, grant.bytes, Str("data buffer ", grant.id), &seg));
        buffers_[grant.id] = std::move(seg);
      }
      timeout_ms = 0;
    }
    return Status::Error(Code::kAborted, "the worker closed the channel");
  }

  // -- the hierarchical allreduce (shm/host.h) ---------------------------------------------------

  // The host segment arrives on the worker's socket before `go`.
  Status ReceiveHost() {
    const Deadline deadline = Deadline::After(ch_->timeout_seconds);
    while (!host_.attached()) {
      if (Stopping()) return Status::Error(Code::kAborted, "stopping");
      if (deadline.Expired()) return Status::Error(Code::kTimeout, "the worker never handed over the host segment");
      FHVD_RETURN_IF_ERROR(ReceiveSegments(100));
    }
    host_.header()->posts[lane_][ch_->local_rank].proxy_pid = getpid();
    return Status::Ok();
  }

  // Lane j's shard among the L local ranks: reduce-scatter in shared memory, this part's ring across
  // hosts, allgather in shared memory, the first and last overlapping the ring segment by segment;
  // two meetings of the host's lane-j proxies (host.h).
  // A failure outside the ring (a local rank's proxy gone, a timeout while meeting) is sent round the
  // ring of this local rank like any lane failure, so that the other hosts fail at once too.
  Status ExecuteHost(const RequestDesc& r, const CollectiveDesc& desc, const ShardWork& work, RingStats* stats) {
    bool ring_ran = false;
    Status st = HostPhases(r, desc, work, stats, &ring_ran);
    stats->end_ns = NowNs();  // also after a failure (the lane's busy time counts it)
    if (!st.ok() && !ring_ran && !links_.to_next.empty()) {
      std::atomic<uint32_t> raised{1};
      const uint32_t code = static_cast<uint32_t>(st.code());
      const std::string reason = Str("rank ", ch_->rank, " lane ", lane_, ": ", st.message());
      RingOptions tell = options_;
      tell.abort = &raised;
      tell.abort_reason = reason.c_str();
      tell.abort_code = &code;
      ShardWork nothing = work;
      nothing.data = nullptr;
      nothing.count = 0;
      RingStats unused;
      (void)RingAllreduce(links_, desc, nothing, tell, &unused);  // fails at once, after sending the abort
    }
    return st;
  }

  Status HostPhases(const RequestDesc& r, CollectiveDesc desc, ShardWork work, RingStats* stats, bool* ring_ran) {
    stats->start_ns = NowNs();
    // A reduce-scatter or an allgather of rows runs here as the hierarchical allreduce of its rows
    // (fasthorovod/proxy/rows.py): every local rank ends with every row, summed, and the worker copies
    // out what it needs. For an allgather each worker stages its own rows among zeros, as integer
    // words of the element's size, so that the sum carries every bit. Across hosts this moves twice
    // the bytes of the ring's phase alone, through the same lanes.
    if (RowsPerRank(r.op)) desc.op = static_cast<uint16_t>(ReduceOp::kSum);
    HostHeader* host = host_.header();
    const uint32_t L = ch_->local_size, me = ch_->local_rank;
    const uint32_t n = ++host_collectives_;
    HostPost& post = host->posts[lane_][me];
    post.buffer_id = r.buffer_id;
    post.buffer_offset = r.buffer_offset;
    post.count = r.count;
    post.dtype = r.dtype;
    post.op = r.op;
    post.lane_begin = r.lane_begin[lane_];
    post.lane_end = r.lane_begin[lane_ + 1];
    post.name_hash = r.name_hash;
    Scale(work.dtype, work.data, work.count, work.prescale);  // this rank's input, once
    FHVD_RETURN_IF_ERROR(Meet(&HostPost::posted, n, "post its data"));

    const size_t elem = DTypeSize(work.dtype);
    std::vector<char*> shards(L);
    for (uint32_t m = 0; m < L; ++m) {
      if (m == me) {
        shards[m] = static_cast<char*>(work.data);
        continue;
      }
      const HostPost& peer = host->posts[lane_][m];
      if (peer.count != r.count || peer.dtype != r.dtype || peer.op != r.op || peer.lane_begin != post.lane_begin ||
          peer.lane_end != post.lane_end) {
        return Status::Error(Code::kMismatch,
                             Str("local rank ", m, " posted a different collective to lane ", lane_, " (", peer.count,
                                 " elements of dtype ", peer.dtype, ", op ", peer.op, ", shard [", peer.lane_begin, ", ",
                                 peer.lane_end, ")) than local rank ", me, " ('", r.name, "': ", r.count,
                                 " elements of dtype ", r.dtype, ", op ", r.op, ", shard [", post.lane_begin, ", ",
                                 post.lane_end, "))"));
      }
      ShmSegment* buffer = nullptr;
      FHVD_RETURN_IF_ERROR(PeerBuffer(m, peer.buffer_id, &buffer));
      if (peer.buffer_offset + peer.count * elem > buffer->size()) {
        return Status::Error(Code::kInvalidArgument, Str("local rank ", m, "'s request exceeds its data buffer"));
      }
      shards[m] = static_cast<char*>(buffer->data()) + peer.buffer_offset + post.lane_begin * elem;
    }
    size_t begin = ChunkBegin(work.count, L, me);
    HostPart part(shards, me, begin * elem, work.dtype);
    const size_t count = ChunkBegin(work.count, L, me + 1) - begin;
    ShardWork across = work;
    across.data = shards[me] + begin * elem;
    across.count = count;
    across.prescale = 1.0;
    across.host = &part;
    if (ch_->num_hosts > 1) {
      desc.shard_bytes = count * elem;
      RingStats ring;
      *ring_ran = true;
      Status st = RingAllreduce(links_, desc, across, options_, &ring);
      stats->bytes_sent = ring.bytes_sent;
      stats->bytes_received = ring.bytes_received;
      stats->rehash_in = ring.rehash_in;
      FHVD_RETURN_IF_ERROR(st);
    } else {
      ReduceWithoutRing(across, options_.segment_bytes);
    }
    return Meet(&HostPost::copied, n, "copy its part out");
  }

  // This local rank's part of lane j's shard, as the ring sees it (collectives/ring.h): its
  // elements in every local rank's data buffer. Only this proxy reads or writes that part of the
  // others' buffers during the collective, so it reads them as they were posted (prescaled) and
  // overwrites them with the result.
  class HostPart : public HostShare {
   public:
    HostPart(const std::vector<char*>& shards, uint32_t me, size_t offset, DType dtype)
        : shards_(shards), me_(me), offset_(offset), dtype_(dtype), elem_(DTypeSize(dtype)) {}
    void ReduceIn(size_t begin, size_t count) override {
      char* mine = At(me_, begin);
      for (uint32_t m = 0; m < shards_.size(); ++m) {
        if (m != me_) ReduceSum(dtype_, mine, At(m, begin), count);
      }
    }
    void CopyOut(size_t begin, size_t count) override {
      for (uint32_t m = 0; m < shards_.size(); ++m) {
        if (m != me_) std::memcpy(At(m, begin), At(me_, begin), count * elem_);
      }
    }

   private:
    char* At(uint32_t m, size_t element) const { return shards_[m] + offset_ + element * elem_; }
    const std::vector<char*>& shards_;
    const uint32_t me_;
    const size_t offset_;  // bytes: the part's start within the lane's shard
    const DType dtype_;
    const size_t elem_;
  };

  // Marks this local rank as having reached `point` of hierarchical collective n and waits until the
  // lane's other local ranks have too: bounded by the timeout, the abort flags (100 ms), and the
  // other proxies' lives.
  Status Meet(std::atomic<uint32_t> HostPost::*point, uint32_t n, const char* what) {
    HostHeader* host = host_.header();
    HostPost& mine = host->posts[lane_][ch_->local_rank];
    (mine.*point).store(n, std::memory_order_release);
    FutexWakeAll(&(mine.*point));
    const Deadline deadline = Deadline::After(ch_->timeout_seconds);
    for (uint32_t m = 0; m < ch_->local_size; ++m) {
      if (m == ch_->local_rank) continue;
      HostPost& peer = host->posts[lane_][m];
      for (;;) {
        const uint32_t seen = (peer.*point).load(std::memory_order_acquire);
        if (static_cast<int32_t>(seen - n) >= 0) break;
        if (host->abort.load() != 0) {
          // Another rank's failure is a peer's here, whatever it was there (a dead proxy of rank 1
          // is rank 1's ProxyDiedError and everyone else's FastHorovodError), as in the ring.
          const Code code = CodeFromWire(host->abort_code);
          return Status::Error(host->abort_rank == ch_->rank ? code : CodeFromPeer(code),
                               Str("on this host, ", std::string(host->abort_reason, strnlen(host->abort_reason,
                                                                                             kErrorBytes))));
        }
        if (ch_->abort.load() != 0) return JobAbort();
        if (Stopping()) return Status::Error(Code::kAborted, "the worker stopped its proxies");
        const int32_t pid = peer.proxy_pid;
        if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) {
          return Status::Error(Code::kPeerError, Str("the lane ", lane_, " proxy of local rank ", m, " (pid ", pid,
                                                     ") exited while this one waited for it to ", what));
        }
        if (deadline.Expired()) {
          return Status::Error(Code::kTimeout, Str("local rank ", m, "'s lane ", lane_, " proxy did not ", what,
                                                   " within ", ch_->timeout_seconds, " s"));
        }
        FutexWait(&(peer.*point), seen, 100);
      }
    }
    return Status::Ok();
  }

  // Local rank m's data buffer `id`, mapped at its first use and kept.
  Status PeerBuffer(uint32_t m, uint32_t id, ShmSegment** out) {
    const uint64_t key = (uint64_t{m} << 32) | id;
    auto it = peer_buffers_.find(key);
    if (it == peer_buffers_.end()) {
      ShmSegment seg;
      FHVD_RETURN_IF_ERROR(host_.MapBuffer(m, id, &seg));
      it = peer_buffers_.emplace(key, std::move(seg)).first;
    }
    *out = &it->second;
    return Status::Ok();
  }

  // A failure here fails every hierarchical collective of the host: the other local ranks' proxies
  // stop waiting for this one at once.
  void AbortHost(const Status& why) {
    HostHeader* host = host_.header();
    RaiseHostAbort(host, ch_->rank, why);
    for (uint32_t lane = 0; lane < ch_->num_lanes; ++lane) {
      for (uint32_t m = 0; m < ch_->local_size; ++m) {
        FutexWakeAll(&host->posts[lane][m].posted);
        FutexWakeAll(&host->posts[lane][m].copied);
      }
    }
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
  Socket listener_;    // open while the lane has a ring: re-hashed connections come in here...
  Socket alt_listener_;  // ...and here (the ring's second port)
  Socket mesh_listener_;             // the alltoall mesh's connections come in here
  std::vector<RingLinks> mesh_;      // by distance, once the first alltoall connected it
  LinkIdentity self_;  // what this lane proves to its ring neighbours
  RingEndpoint next_;
  RingLinks links_;
  RingOptions options_;
  uint64_t rehash_out_ = 0;  // sockets announced in the collective just run (lane.h), replaced
  uint64_t rehash_in_ = 0;   // after its result is out (Handle)
  std::unordered_map<uint32_t, ShmSegment> buffers_;
  HostSegment host_;                               // the hierarchical allreduce's meeting place
  std::map<uint64_t, ShmSegment> peer_buffers_;    // (local rank << 32 | id): the other workers' buffers
  uint32_t host_collectives_ = 0;                  // hierarchical collectives this lane has started
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
