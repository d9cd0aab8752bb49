#include "proxy/client.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "shm/handoff.h"

namespace fasthorovod {

Status ProxyChannel::Create(const ChannelConfig& config, std::unique_ptr<ProxyChannel>* out) {
  if (config.num_lanes == 0 || config.num_lanes > kMaxLanes) {
    return Status::Error(Code::kInvalidArgument, Str("number of proxies must be in [1, ", kMaxLanes, "], got ",
                                                     config.num_lanes));
  }
  if (config.token.size() != kTokenBytes) return Status::Error(Code::kInvalidArgument, "job token must be 16 bytes");
  std::unique_ptr<ProxyChannel> channel(new ProxyChannel());
  FHVD_RETURN_IF_ERROR(ShmSegment::Create(sizeof(ChannelHeader), Str("rank ", config.rank, "'s proxy channel"),
                                          &channel->segment_));
  auto* h = static_cast<ChannelHeader*>(channel->segment_.data());  // zero-filled
  h->magic = kChannelMagic;
  h->version = kChannelVersion;
  h->num_lanes = config.num_lanes;
  h->rank = config.rank;
  h->size = config.size;
  h->sockets_per_lane = 1;  // until Connect says how many
  h->socket_buffer_bytes = config.socket_buffer_bytes;
  h->segment_bytes = config.segment_bytes;
  h->timeout_seconds = config.timeout_seconds;
  h->config_hash = config.config_hash;
  std::memcpy(h->token, config.token.data(), kTokenBytes);
  h->worker_pid = getpid();
  CopyString(h->bind_host, config.bind_host);
  channel->header_ = h;
  for (uint32_t lane = 0; lane < config.num_lanes; ++lane) {
    int pair[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) != 0) {
      return Status::Error(Code::kIoError, Str("socketpair(): ", ErrnoString(errno)));
    }
    channel->worker_socks_.push_back(pair[0]);
    channel->proxy_socks_.push_back(pair[1]);
    FHVD_RETURN_IF_ERROR(SendSegment(pair[0], kChannelSegment, sizeof(ChannelHeader), channel->segment_.fd(),
                                     Deadline::After(config.timeout_seconds)));
  }
  channel->segment_.CloseFd();
  *out = std::move(channel);
  return Status::Ok();
}

ProxyChannel::~ProxyChannel() {
  if (header_ != nullptr) Stop();
  watch_.Terminate(0.5);  // only reached with proxies running when the owner never shut them down
  for (int fd : worker_socks_) close(fd);
  for (int fd : proxy_socks_) {
    if (fd >= 0) close(fd);
  }
}

int ProxyChannel::ProxyFd(uint32_t lane) const {
  return lane < proxy_socks_.size() ? proxy_socks_[lane] : -1;
}

Status ProxyChannel::WatchProxy(uint32_t lane, int pid) {
  if (lane >= header_->num_lanes) return Status::Error(Code::kInvalidArgument, "lane out of range");
  if (proxy_socks_[lane] >= 0) {
    close(proxy_socks_[lane]);  // the proxy holds it now; a later proxy must not inherit it
    proxy_socks_[lane] = -1;
  }
  return watch_.Add(lane, pid);
}

Status ProxyChannel::CreateBuffer(uint32_t id, size_t bytes, ShmSegment* out) {
  ShmSegment seg;
  FHVD_RETURN_IF_ERROR(
      ShmSegment::Create(bytes, Str("a ", HumanBytes(bytes), " data buffer of rank ", header_->rank), &seg));
  const Deadline deadline = Deadline::After(header_->timeout_seconds);
  for (int sock : worker_socks_) FHVD_RETURN_IF_ERROR(SendSegment(sock, id, bytes, seg.fd(), deadline));
  if (hierarchical()) {
    std::lock_guard<std::mutex> lock(host_mu_);
    // The other local ranks' proxies open it through /proc/<this pid>/fd/<fd>: the fd stays open.
    FHVD_RETURN_IF_ERROR(host_.Publish(header_->local_rank, id, seg.fd(), bytes));
  } else {
    seg.CloseFd();  // the proxies hold their own descriptors (or will, once they read them)
  }
  *out = std::move(seg);
  return Status::Ok();
}

std::string ProxyChannel::Token() const {
  return std::string(reinterpret_cast<const char*>(header_->token), kTokenBytes);
}

Status ProxyChannel::CreateHost(uint32_t local_size, int* fd) {
  FHVD_RETURN_IF_ERROR(HostSegment::Create(local_size, Token(), &host_));
  *fd = host_.fd();
  return Status::Ok();
}

Status ProxyChannel::OpenHost(int pid, int fd, uint32_t local_size) {
  return HostSegment::Open(pid, fd, local_size, Token(), &host_);
}

Status ProxyChannel::AttachHost(uint32_t local_rank, uint32_t host_index, uint32_t num_hosts) {
  if (!host_.attached()) return Status::Error(Code::kInvalidArgument, "no host segment: CreateHost or OpenHost first");
  HostHeader* host = host_.header();
  if (local_rank >= host->local_size || num_hosts == 0 || host_index >= num_hosts) {
    return Status::Error(Code::kInvalidArgument, Str("bad hierarchical place: local rank ", local_rank, " of ",
                                                     host->local_size, ", host ", host_index, " of ", num_hosts));
  }
  if (header_->go.load() != 0) return Status::Error(Code::kInvalidArgument, "AttachHost after Connect");
  host->worker_pid[local_rank] = getpid();
  header_->local_rank = local_rank;
  header_->local_size = host->local_size;
  header_->host_index = host_index;
  header_->num_hosts = num_hosts;
  const Deadline deadline = Deadline::After(header_->timeout_seconds);
  for (int sock : worker_socks_) {
    FHVD_RETURN_IF_ERROR(SendSegment(sock, kHostSegment, sizeof(HostHeader), host_.fd(), deadline));
  }
  return Status::Ok();
}

// The first of this worker's proxies that has exited (kProxyDied), waiting up to wait_ms for one
// to; Ok if none has. The watch reaps exited proxies at once (proxy/watch.h).
Status ProxyChannel::ExitedProxy(int wait_ms) const {
  std::string how;
  const int lane = watch_.FirstExited(wait_ms, &how);
  if (lane < 0) return Status::Ok();
  return Status::Error(Code::kProxyDied, Str("the proxy process of rank ", header_->rank, " lane ", lane,
                                             " exited unexpectedly (", how, "); see its stderr"));
}

Status ProxyChannel::CheckProxiesAlive() {
  // Exits first: a proxy that died is the root cause of whatever its sibling lanes report after it
  // (their collectives fail once the other ranks react), so it is what this worker raises.
  FHVD_RETURN_IF_ERROR(ExitedProxy(0));
  for (uint32_t lane = 0; lane < header_->num_lanes; ++lane) {
    const LaneInfo& info = header_->lanes[lane];
    if (info.state.load() == static_cast<uint32_t>(LaneState::kFailed)) {
      return RootCause(
          Status::Error(CodeFromWire(info.error_code), Str("rank ", header_->rank, " lane ", lane, ": ", info.error)));
    }
  }
  return Status::Ok();
}

// A lane's failure that came from elsewhere (another rank's report, a broken connection) may be
// the echo of one of this worker's own proxies dying a moment ago: a killed process takes a while
// to exit on a loaded machine, and the other ranks can react and report back first. So before such
// a failure is reported, the proxies get a short grace period to show an exit; a proxy that exited
// is the root cause. Only failures (rare) pay the wait.
Status ProxyChannel::RootCause(const Status& failure) {
  if (failure.code() == Code::kMismatch || failure.code() == Code::kTimeout ||
      failure.code() == Code::kInvalidArgument || failure.code() == Code::kProxyDied) {
    return failure;
  }
  Status exited = ExitedProxy(250);
  return exited.ok() ? failure : exited;
}

Status ProxyChannel::WaitListening(double timeout_seconds, std::vector<std::vector<int>>* ports) {
  Deadline deadline = Deadline::After(timeout_seconds);
  for (uint32_t lane = 0; lane < header_->num_lanes; ++lane) {
    while (header_->lanes[lane].state.load() < static_cast<uint32_t>(LaneState::kListening)) {
      FHVD_RETURN_IF_ERROR(CheckProxiesAlive());
      if (deadline.Expired()) {
        return Status::Error(Code::kTimeout, Str("proxy of lane ", lane, " did not start listening within ",
                                                 timeout_seconds, " s"));
      }
      usleep(2000);
    }
    FHVD_RETURN_IF_ERROR(CheckProxiesAlive());
    ports->push_back({header_->lanes[lane].listen_port, header_->lanes[lane].alt_listen_port});
  }
  return Status::Ok();
}

std::vector<int> ProxyChannel::MeshPorts() const {
  std::vector<int> ports;
  for (uint32_t lane = 0; lane < header_->num_lanes; ++lane) ports.push_back(header_->lanes[lane].mesh_port);
  return ports;
}

Status ProxyChannel::Connect(const std::vector<std::string>& next_hosts, const std::vector<std::vector<int>>& next_ports,
                             uint32_t sockets_per_lane, double timeout_seconds,
                             const std::vector<std::string>& mesh_hosts,
                             const std::vector<std::vector<int>>& mesh_ports) {
  if (next_hosts.size() != header_->num_lanes || next_ports.size() != header_->num_lanes) {
    return Status::Error(Code::kInvalidArgument, "one next address per lane is required");
  }
  for (uint32_t lane = 0; lane < header_->num_lanes; ++lane) {
    if (next_ports[lane].empty() || next_ports[lane].size() > 2) {
      return Status::Error(Code::kInvalidArgument, Str("lane ", lane, "'s next ports: one or two are required, got ",
                                                       next_ports[lane].size()));
    }
  }
  if (!mesh_hosts.empty()) {
    if (mesh_hosts.size() != header_->size || mesh_ports.size() != header_->size ||
        header_->size > kMaxMeshRanks) {
      return Status::Error(Code::kInvalidArgument, Str("the mesh needs one address and port list per rank (",
                                                       header_->size, " ranks, at most ", kMaxMeshRanks, ")"));
    }
    for (uint32_t r = 0; r < header_->size; ++r) {
      if (mesh_ports[r].size() != header_->num_lanes) {
        return Status::Error(Code::kInvalidArgument, Str("rank ", r, "'s mesh ports: one per lane is required"));
      }
      CopyString(header_->mesh_hosts[r], mesh_hosts[r]);
      for (uint32_t lane = 0; lane < header_->num_lanes; ++lane) header_->mesh_ports[r][lane] = mesh_ports[r][lane];
    }
    header_->mesh_size = header_->size;
  }
  if (sockets_per_lane < 1 || sockets_per_lane > kMaxSocketsPerLane) {
    return Status::Error(Code::kInvalidArgument, Str("sockets per lane must be in [1, ", kMaxSocketsPerLane,
                                                     "], got ", sockets_per_lane));
  }
  header_->sockets_per_lane = sockets_per_lane;
  for (uint32_t lane = 0; lane < header_->num_lanes; ++lane) {
    CopyString(header_->lanes[lane].next_host, next_hosts[lane]);
    header_->lanes[lane].next_port = next_ports[lane][0];
    header_->lanes[lane].next_alt_port = next_ports[lane].size() > 1 ? next_ports[lane][1] : 0;
  }
  header_->go.store(1, std::memory_order_release);
  FutexWakeAll(&header_->go);
  Deadline deadline = Deadline::After(timeout_seconds);
  for (uint32_t lane = 0; lane < header_->num_lanes; ++lane) {
    while (header_->lanes[lane].state.load() != static_cast<uint32_t>(LaneState::kConnected)) {
      FHVD_RETURN_IF_ERROR(CheckProxiesAlive());
      if (deadline.Expired()) {
        return Status::Error(Code::kTimeout, Str("rank ", header_->rank, " lane ", lane,
                                                 ": ring not connected within ", timeout_seconds, " s"));
      }
      usleep(2000);
    }
  }
  return Status::Ok();
}

Status ProxyChannel::Post(const RequestDesc& request, uint64_t* seq) {
  if (request.num_lanes != header_->num_lanes) {
    return Status::Error(Code::kInvalidArgument, Str("the request describes ", request.num_lanes,
                                                     " lane boundaries sets but the channel has ",
                                                     header_->num_lanes, " lanes"));
  }
  if (request.lane_begin[0] != 0 || request.lane_begin[request.num_lanes] != request.count) {
    return Status::Error(Code::kInvalidArgument, "lane boundaries must run from 0 to the element count");
  }
  for (uint32_t lane = 0; lane < request.num_lanes; ++lane) {
    if (request.lane_begin[lane] > request.lane_begin[lane + 1]) {
      return Status::Error(Code::kInvalidArgument, Str("lane boundaries must not decrease (lane ", lane, ")"));
    }
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (!broken_.ok()) return broken_;
  while (head_ - tail_ >= kNumSlots) {
    const uint64_t oldest = tail_;
    lock.unlock();
    Status st = WaitSlot(oldest, header_->timeout_seconds);
    lock.lock();
    if (!st.ok()) return st;
    ReapLocked();
  }
  RequestSlot& slot = Slot(head_);
  slot.lanes_done.store(0, std::memory_order_relaxed);
  slot.failed.store(0, std::memory_order_relaxed);
  slot.error_code = 0;
  slot.error[0] = '\0';
  slot.desc = request;
  slot.desc.seq = head_;
  slot.desc.name[kNameBytes - 1] = '\0';
  collected_[head_ % kNumSlots] = false;
  *seq = head_++;
  header_->head.store(static_cast<uint32_t>(head_), std::memory_order_release);
  FutexWakeAll(&header_->head);
  return Status::Ok();
}

void ProxyChannel::CollectLocked(uint64_t seq) {
  if (seq < tail_ || collected_[seq % kNumSlots]) return;
  RequestSlot& slot = Slot(seq);
  Status result = Status::Ok();
  if (slot.failed.load(std::memory_order_acquire) != 0) {
    slot.error[kErrorBytes - 1] = '\0';
    result = RootCause(Status::Error(CodeFromWire(slot.error_code), slot.error));
    if (broken_.ok()) broken_ = result;
    RaiseAbort(header_, result);
  }
  results_[seq] = result;
  collected_[seq % kNumSlots] = true;
}

void ProxyChannel::ReapLocked() {
  while (tail_ < head_ && collected_[tail_ % kNumSlots]) {
    collected_[tail_ % kNumSlots] = false;
    ++tail_;
  }
}

bool ProxyChannel::Poll(uint64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  if (results_.count(seq) || seq < tail_) return true;
  if (!broken_.ok()) return true;
  if (!SlotComplete(seq)) return CheckProxiesAlive().ok() ? false : true;
  CollectLocked(seq);
  ReapLocked();
  return true;
}

Status ProxyChannel::WaitSlot(uint64_t seq, double timeout_seconds) {
  RequestSlot& slot = Slot(seq);
  const int64_t timeout_ns = static_cast<int64_t>(timeout_seconds * 1e9);
  const int64_t start = NowNs();
  for (;;) {
    uint32_t done = slot.lanes_done.load(std::memory_order_acquire);
    if (done == header_->num_lanes) {
      std::lock_guard<std::mutex> lock(mu_);
      CollectLocked(seq);
      return Status::Ok();
    }
    Status alive = CheckProxiesAlive();
    if (!alive.ok()) return Fail(alive);
    // Time out when no lane has moved a byte (or finished anything) for timeout_seconds.
    int64_t last = start;
    for (uint32_t lane = 0; lane < header_->num_lanes; ++lane) {
      last = std::max(last, header_->lanes[lane].progress_ns.load(std::memory_order_relaxed));
    }
    if (NowNs() - last > timeout_ns) {
      return Fail(Status::Error(Code::kTimeout,
                                Str("timed out: no progress on any lane of rank ", header_->rank, " for ",
                                    timeout_seconds, " s (FASTHOROVOD_TIMEOUT_SECONDS); a peer rank or its "
                                    "proxies may be stopped, dead or running a different collective")));
    }
    FutexWait(&slot.lanes_done, done, 50);
  }
}

Status ProxyChannel::Fail(const Status& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (broken_.ok()) broken_ = why;
  RaiseAbort(header_, broken_);
  return broken_;
}

Status ProxyChannel::Wait(uint64_t seq, double timeout_seconds) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = results_.find(seq);
    if (it != results_.end()) {
      Status st = it->second;
      results_.erase(it);
      return st;
    }
    if (seq >= head_) return Status::Error(Code::kInvalidArgument, Str("unknown request ", seq));
    if (seq < tail_ || collected_[seq % kNumSlots]) {
      return Status::Error(Code::kInvalidArgument, Str("request ", seq, " was already waited for"));
    }
    if (!broken_.ok()) return broken_;
  }
  FHVD_RETURN_IF_ERROR(WaitSlot(seq, timeout_seconds));
  std::lock_guard<std::mutex> lock(mu_);
  ReapLocked();
  auto it = results_.find(seq);
  Status st = it != results_.end() ? it->second : Status::Ok();
  if (it != results_.end()) results_.erase(it);
  return st;
}

Status ProxyChannel::Health() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.ok()) return broken_;
  }
  Status alive = CheckProxiesAlive();
  // After Stop() the proxies leave: an exit then is this worker's own shutdown, not a failure to
  // report to the other ranks, whose last collectives may still be receiving what this rank sent
  // (collectives in flight at shutdown were aborted before the stop: ProxyGroup.close). Read after
  // the exit was seen: a proxy leaves only once it has seen the stop.
  if (!alive.ok() && header_->stop.load() != 0) return Status::Ok();
  return alive;
}

void ProxyChannel::Stop() {
  header_->stop.store(1);
  FutexWakeAll(&header_->head);
  FutexWakeAll(&header_->go);
}

Status ProxyChannel::SetTrace(const std::string& dir, int64_t clock_offset_ns, double timeout_seconds) {
  if (dir.size() >= kTraceDirBytes) return Status::Error(Code::kInvalidArgument, "trace directory path too long");
  CopyString(header_->trace_dir, dir);
  header_->trace_clock_offset_ns = clock_offset_ns;
  const uint32_t gen = header_->trace_generation.fetch_add(1, std::memory_order_acq_rel) + 1;
  FutexWakeAll(&header_->head);
  if (!dir.empty()) return Status::Ok();  // the next request sees it (ordered before the head bump)
  Deadline deadline = Deadline::After(timeout_seconds);
  for (uint32_t j = 0; j < header_->num_lanes; ++j) {
    LaneInfo& lane = header_->lanes[j];
    // A lane that exited or was killed has no trace to close (its file keeps what it flushed).
    while (lane.trace_ack.load(std::memory_order_acquire) != gen &&
           lane.state.load() == static_cast<uint32_t>(LaneState::kConnected) && !watch_.Exited(j)) {
      if (deadline.Expired()) return Status::Error(Code::kTimeout, Str("lane ", j, " did not close its trace"));
      usleep(1000);
    }
  }
  return Status::Ok();
}

bool ProxyChannel::InFlight() {
  std::lock_guard<std::mutex> lock(mu_);
  for (uint64_t seq = tail_; seq < head_; ++seq) {
    if (!collected_[seq % kNumSlots] && !SlotComplete(seq)) return true;
  }
  return false;
}

void ProxyChannel::Break(const Status& why) { (void)Fail(why); }

void ProxyChannel::Abort() {
  RaiseAbort(header_, Status::Error(Code::kAborted,
                                    Str("rank ", header_->rank, " shut down while collectives were in flight")));
  Stop();
}

LaneSnapshot ProxyChannel::Lane(uint32_t lane) const {
  LaneSnapshot s;
  if (lane >= header_->num_lanes) return s;
  const LaneInfo& info = header_->lanes[lane];
  s.state = info.state.load();
  s.pid = info.pid;
  s.port = info.listen_port;
  s.alt_port = info.alt_listen_port;
  if (s.state == static_cast<uint32_t>(LaneState::kFailed)) {
    s.error_code = info.error_code;
    s.error = info.error;
  }
  s.bytes_sent = info.bytes_sent.load();
  s.bytes_received = info.bytes_received.load();
  s.collectives = info.collectives.load();
  s.zero_filled = info.zero_filled.load();
  s.busy_ns = info.busy_ns.load();
  s.mesh_bytes_sent = info.mesh_bytes_sent.load();
  s.mesh_bytes_received = info.mesh_bytes_received.load();
  s.rehashes = info.rehashes.load();
  s.rehash_ns = info.rehash_ns.load();
  return s;
}

std::vector<std::pair<uint64_t, uint64_t>> ProxyChannel::SocketProgress(uint32_t lane) const {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  if (lane >= header_->num_lanes) return out;
  const LaneInfo& info = header_->lanes[lane];
  for (uint32_t s = 0; s < header_->sockets_per_lane && s < kMaxSocketsPerLane; ++s) {
    out.emplace_back(info.sockets[s].bytes_sent.load(std::memory_order_relaxed),
                     info.sockets[s].backlogged_ns.load(std::memory_order_relaxed));
  }
  return out;
}

Status ProxyChannel::RequestRehash(uint32_t lane, uint64_t mask) {
  const uint32_t sockets = header_->sockets_per_lane;
  const uint64_t valid = sockets >= 64 ? ~uint64_t{0} : (uint64_t{1} << sockets) - 1;
  if (lane >= header_->num_lanes || (mask & ~valid) != 0) {
    return Status::Error(Code::kInvalidArgument, Str("no socket ", mask, " (a mask) on lane ", lane, " of ",
                                                     header_->num_lanes, " lanes with ", sockets, " sockets each"));
  }
  header_->lanes[lane].rehash_request.fetch_or(mask, std::memory_order_acq_rel);
  return Status::Ok();
}

void ProxyChannel::LaneProgress(uint32_t lane, uint64_t* bytes_sent, uint64_t* busy_ns) const {
  *bytes_sent = *busy_ns = 0;
  if (lane >= header_->num_lanes) return;
  const LaneInfo& info = header_->lanes[lane];
  *bytes_sent = info.bytes_sent.load();
  *busy_ns = info.busy_ns.load();
}

}  // namespace fasthorovod
