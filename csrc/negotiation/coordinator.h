// The coordinator: decides one order of the collectives every rank has submitted.
//
// Horovod's ranks may submit collectives in any order and from any thread; its coordinator (rank
// 0's background thread) starts a collective only when every rank has submitted it, and tells all
// ranks to run it, in one order they all follow. This is the same for FastHorovod's proxied
// collectives, in C++ and on its own TCP connections (one per rank to rank 0), never through
// Horovod's own collectives:
//
//   * Each rank's member (negotiation/member.h) announces what it submitted, in batches (one frame
//     per wake-up of its thread carries everything submitted since the last one). A collective the
//     coordinator has already run under the same name with the same description is announced by
//     its id alone (the response cache: 4 bytes instead of the description).
//   * A collective is ready when every rank has either submitted it or joined (hvd.join: it takes
//     part with zeros). Ready collectives are sent to every rank in the order they became ready,
//     so a tensor ready everywhere never waits behind one that is not.
//   * Lane boundaries are computed here, once per run order, by ShardBoundaries (wire.h). Each
//     member tells its rank's lane weights when they change (kWeights, equal at start-up); the
//     coordinator records with every announcement the weights its rank had then, and cuts the run
//     order by those of the lead rank (the lowest rank that submitted the tensor): ranks need not
//     agree on lane weights, rank 0's (or the lowest submitter's) decide. An allgather's row is
//     laid out by equal shares of its width (count / size elements) on every rank, so its
//     boundaries are size x ShardBoundaries(width, equal), whatever the weights.
//   * Ranks that disagree about a name (shape, dtype, op, scale factors, size) get an error for
//     that tensor on every rank, naming the field and the ranks; nothing reaches the proxies, so
//     the lanes stay up and the next collective works.
//   * Stall inspector (as Horovod's): a tensor some ranks submitted and others not for longer than
//     the stall-check time is reported once on stderr with the missing ranks; past the stall
//     shutdown time (off unless set) it fails with an error on every rank.
//   * When every rank has joined, each gets the last rank to join (the order of JOINs here).
//   * A rank whose connection drops without saying goodbye has died: every rank is told, and
//     their pending collectives fail instead of hanging.
//   * What a member sends is checked before it is stored or indexed (wire.h: name, shape text,
//     dtype, op, size against max_tensor_bytes, an allgather's count against the ranks, lane
//     weights and their number, cached ids, at most kMaxPendingCollectives waiting): a member
//     that breaks the protocol — it holds the token, so
//     it is a bug or a compromised process of the job — fails the job on every rank, with an
//     error naming it and the field.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "negotiation/wire.h"
#include "transport/socket.h"

namespace fasthorovod {

struct CoordinatorOptions {
  uint32_t size = 1;
  std::string token;                    // kTokenBytes: members must prove they hold it (never sent)
  std::string bind_host;
  double timeout_seconds = 120.0;       // members' connections at start-up; sends
  double stall_check_seconds = 60.0;    // 0: no stall warnings
  double stall_shutdown_seconds = 0.0;  // 0: stalled tensors wait for ever (Horovod's default)
  uint64_t max_tensor_bytes = DefaultMaxTensorBytes();  // announcements of larger ones: protocol error
};

class Coordinator {
 public:
  // Binds a listener (port in *port) and starts the coordinator thread, which accepts the members.
  static Status Start(const CoordinatorOptions& options, std::unique_ptr<Coordinator>* out, int* port);
  ~Coordinator();  // stops the thread

  // Stops the thread and closes the connections (idempotent).
  void Stop();
  // Why the coordinator stopped on its own ("" while it runs or after Stop()).
  std::string error() const;

 private:
  using Weights = std::shared_ptr<const std::vector<double>>;  // shared until the rank's next kWeights
  struct Pending {
    std::string name;
    std::vector<bool> submitted;           // per rank
    std::vector<WireDesc> desc;            // per rank, valid where submitted
    std::vector<Weights> weights;          // per rank where submitted: its lane weights when it announced
    uint32_t count = 0;
    int64_t first_ns = 0;
    uint64_t arrival = 0;                  // order of first submission
    bool warned = false;
  };

  explicit Coordinator(const CoordinatorOptions& options) : opt_(options) {}
  void Run();
  Status Serve();
  Status AcceptMembers();
  Status Handle(uint32_t rank, MsgType type, const std::string& payload);
  Status Announce(uint32_t rank, WireReader& in);
  Status SetWeights(uint32_t rank, WireReader& in);
  Status Submit(uint32_t rank, WireDesc desc);
  void Join(uint32_t rank);
  void Leave(uint32_t rank);
  void Settle();                             // moves ready or doomed pending entries to the batch
  bool Ready(const Pending& p) const;
  void Finish(Pending& p);                   // appends a run or an error to the batch
  void Error(const std::string& name, Code code, const std::string& message);
  void CheckStalls();
  Status Flush();                            // sends the batch to every member
  void Broadcast(MsgType type, const std::string& payload);

  CoordinatorOptions opt_;
  Socket listener_;
  std::vector<Socket> members_;              // by rank
  std::vector<bool> joined_, gone_;
  std::vector<Weights> weights_;             // by rank: its current lane weights (null before its first)
  uint32_t joined_count_ = 0;
  std::unordered_map<std::string, Pending> pending_;
  uint64_t arrivals_ = 0;
  std::unordered_map<std::string, uint32_t> id_of_;  // name -> id
  std::vector<WireDesc> by_id_;                      // id -> the description last run under it
  WireWriter batch_;
  uint32_t batch_count_ = 0;
  int64_t last_stall_check_ns_ = 0;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  mutable std::mutex mu_;
  std::string error_;
};

}  // namespace fasthorovod
