// The worker's side of the channel: create it, hand the proxies their neighbours, post requests,
// and wait for them with a bound on time and an eye on the proxies' liveness.
//
// Errors keep their kind: a lane's failure arrives with the Code its proxy wrote next to the
// message (a mismatch stays kMismatch, a peer's timeout kTimeout), this worker's own no-progress
// timeout is kTimeout, and a proxy process that exited is kProxyDied.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "proxy/watch.h"
#include "shm/channel.h"
#include "shm/host.h"
#include "shm/segment.h"

namespace fasthorovod {

struct ChannelConfig {
  uint32_t num_lanes = 1;
  uint32_t rank = 0;
  uint32_t size = 1;
  int32_t socket_buffer_bytes = 0;
  uint64_t segment_bytes = 1 << 20;
  double timeout_seconds = 300.0;
  uint64_t config_hash = 0;
  std::string token;  // kTokenBytes bytes
  std::string bind_host;
};

struct LaneSnapshot {
  uint32_t state = 0;
  int32_t pid = 0;
  int32_t port = 0;
  int32_t alt_port = 0;  // the ring's second listening port
  uint32_t error_code = 0;  // a Code (state == kFailed)
  std::string error;
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t collectives = 0;
  uint64_t zero_filled = 0;
  uint64_t busy_ns = 0;
  uint64_t mesh_bytes_sent = 0;
  uint64_t mesh_bytes_received = 0;
  uint64_t rehashes = 0;  // send sockets this lane has replaced by new connections
  uint64_t rehash_ns = 0;  // time it spent replacing connections (either side's)
};

class ProxyChannel {
 public:
  // Creates the channel (an anonymous shared-memory segment) and one socket pair per lane, and
  // queues the channel's descriptor on each (shm/handoff.h).
  static Status Create(const ChannelConfig& config, std::unique_ptr<ProxyChannel>* out);
  ~ProxyChannel();  // kills and reaps proxies still running; closes every descriptor

  uint32_t num_lanes() const { return header_->num_lanes; }

  // Set-up: the caller spawns lane j's proxy with ProxyFd(j) inherited (its only way to the
  // worker), then registers its pid: the worker's copy of that descriptor is closed, and the
  // process is watched (reaped as soon as it exits; proxy/watch.h). Then wait until each listens.
  int ProxyFd(uint32_t lane) const;
  Status WatchProxy(uint32_t lane, int pid);
  // `ports[j]` is lane j's ring ports: {port, alt_port} (transport/socket.h, RingEndpoint).
  Status WaitListening(double timeout_seconds, std::vector<std::vector<int>>* ports);
  // After WaitListening: each lane's mesh port (0: the proxies open no mesh).
  std::vector<int> MeshPorts() const;
  // Gives lane j the address of lane j of the next rank (`next_ports[j]`: its ring ports, as
  // WaitListening returned them there; one or two) and lets the proxies connect with
  // `sockets_per_lane` sockets each way (every rank must pass the same number; the configured one,
  // or what the path probe chose); returns once every lane is connected. `mesh_hosts[r]` and
  // `mesh_ports[r][j]` (every rank's address and lanes' mesh ports, or both empty: no mesh) are what
  // the lanes' alltoall mesh connects to when the first alltoall comes (collectives/alltoall.h).
  Status Connect(const std::vector<std::string>& next_hosts, const std::vector<std::vector<int>>& next_ports,
                 uint32_t sockets_per_lane, double timeout_seconds,
                 const std::vector<std::string>& mesh_hosts = {},
                 const std::vector<std::vector<int>>& mesh_ports = {});

  // The hierarchical allreduce (shm/host.h), before Connect: local rank 0 creates the host segment
  // (CreateHost; returns its descriptor, which the others open through /proc), the others open it
  // (OpenHost); then AttachHost records this rank's place, hands the segment to the proxies, and
  // from then on every data buffer is shared with the host (its descriptor stays open).
  Status CreateHost(uint32_t local_size, int* fd);
  Status OpenHost(int pid, int fd, uint32_t local_size);
  Status AttachHost(uint32_t local_rank, uint32_t host_index, uint32_t num_hosts);
  bool hierarchical() const { return header_->local_size > 1; }

  // A zero-filled shared-memory data buffer of `bytes` (pages reserved: a shortage is an error
  // here, never a SIGBUS later) whose descriptor every proxy has been handed under `id` before
  // this returns, so any request posted afterwards may name it.
  Status CreateBuffer(uint32_t id, size_t bytes, ShmSegment* out);

  // Requests. Post never blocks for long: when all slots are in use it waits for the oldest.
  // request.num_lanes must equal num_lanes(); its seq is assigned here.
  Status Post(const RequestDesc& request, uint64_t* seq);
  bool Poll(uint64_t seq);
  Status Wait(uint64_t seq, double timeout_seconds);
  // Ok while the channel works; else why not (the first fatal error, a failed lane, a dead proxy).
  Status Health();
  // The root cause of `failure` as this worker should report it: a failure that came from
  // elsewhere may be the echo of one of its own proxies dying a moment ago, so the proxies get a
  // short grace period (250 ms) to show an exit, which is then the cause (kProxyDied).
  Status RootCause(const Status& failure);

  // Orderly stop (proxies exit their loop) or abort (in-flight collectives fail fast).
  void Stop();
  void Abort();
  // The job failed (`why`: this rank's negotiation heard so): the channel is broken from now on,
  // and every lane aborts with `why`, also one still connecting or waiting for a peer that will
  // never come; its posted collectives fail with it at once instead of at their timeout.
  void Break(const Status& why);
  // Whether a posted request has not completed yet.
  bool InFlight();
  // Waits up to grace_seconds for the proxies to exit, kills the rest, and reaps them all.
  void Terminate(double grace_seconds) { watch_.Terminate(grace_seconds); }
  // A proxy's exit code in Popen's convention (-signal or status); false while it runs.
  bool ExitCode(uint32_t lane, int* code) const { return watch_.ExitCode(lane, code); }
  bool UsesPidfds() const { return watch_.uses_pidfds(); }
  // Starts (dir non-empty) or stops the proxies' traces; a stop waits until every live lane closed its file.
  Status SetTrace(const std::string& dir, int64_t clock_offset_ns, double timeout_seconds);
  LaneSnapshot Lane(uint32_t lane) const;
  // Two counters of Lane(), without copying the rest (read before every request by the balancer).
  void LaneProgress(uint32_t lane, uint64_t* bytes_sent, uint64_t* busy_ns) const;
  // Per send socket of `lane`: (bytes sent, time backlogged in ns), transport/lane.h's
  // SocketCounters; what a re-hashing policy compares.
  std::vector<std::pair<uint64_t, uint64_t>> SocketProgress(uint32_t lane) const;
  // Asks `lane` to replace the send sockets in `mask` (bit s: socket s) by new connections after
  // its next collective (added to any request not taken yet).
  Status RequestRehash(uint32_t lane, uint64_t mask);

 private:
  ProxyChannel() = default;
  RequestSlot& Slot(uint64_t seq) { return header_->slots[seq % kNumSlots]; }
  std::string Token() const;  // the job token, as the header holds it
  bool SlotComplete(uint64_t seq) {
    return Slot(seq).lanes_done.load(std::memory_order_acquire) == header_->num_lanes;
  }
  void CollectLocked(uint64_t seq);  // records the result of a completed slot
  void ReapLocked();                 // frees completed slots in order
  Status CheckProxiesAlive();
  Status ExitedProxy(int wait_ms) const;  // kProxyDied for the first proxy that exited, else Ok
  Status Fail(const Status& why);  // the channel is broken from now on: abort every lane
  Status WaitSlot(uint64_t seq, double timeout_seconds);

  ShmSegment segment_;
  ChannelHeader* header_ = nullptr;
  HostSegment host_;  // attached: the hierarchical allreduce runs
  std::mutex host_mu_;  // CreateBuffer's publication (the worker's pool and the member's zero buffers)
  std::vector<int> worker_socks_;  // the worker's end of each lane's socket pair
  std::vector<int> proxy_socks_;   // the proxy's end, until its proxy was spawned
  ChildWatch watch_;
  std::mutex mu_;
  uint64_t head_ = 0;  // next seq to post
  uint64_t tail_ = 0;  // oldest slot still owned by a request
  std::unordered_map<uint64_t, Status> results_;
  std::vector<bool> collected_ = std::vector<bool>(kNumSlots, false);
  Status broken_;  // first fatal error; every later call fails with it
};

}  // namespace fasthorovod
