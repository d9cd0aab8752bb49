// A rank's member of the negotiation: submits collectives in any order, from any thread, and
// posts them to its proxies in the order the coordinator decides (negotiation/coordinator.h).
//
// Submit() files a ticket and wakes the member's thread, which announces everything submitted
// since its last announcement in one frame (the cached id when the coordinator has already run
// the same description under the name). When the coordinator's run orders arrive, the thread posts
// each collective to the proxy channel in that order, with the lane boundaries the order carries;
// a ticket then waits for its request like any other. While this rank is joined (hvd.join), a run
// order for a collective it did not submit is posted with a zero buffer of the right size, so the
// proxies of a joined rank take part like any other.
//
// Names: the member is the rank's one registry of the names in flight (Horovod's rule). A name is
// registered from Submit until its ticket is consumed by Wait, or until it fails (an error from
// the coordinator, a post that failed, the data plane closing or failing); a second Submit of a
// registered name fails with kInvalidArgument and Horovod's message. So a name can be used again
// as soon as its handle is synchronized, and a run order finds the ticket of its name among those
// submitted and not yet posted (a posted one that is not yet waited on is an earlier collective).
//
// Tickets are numbered from a base the caller chooses (NumberTicketsFrom), so that the facade's
// handle is the ticket itself, and the ticket is also the proxies' trace request number.
//
// Lane weights: this rank's lane weights reach the coordinator (kWeights) only when they change
// (SetLaneWeights), ordered among the announcements: the collectives submitted after the change are
// announced after it. Start-up sends equal weights. The coordinator cuts every run order by the
// lead rank's weights (coordinator.h); the member checks the boundaries it receives.
//
// What the coordinator sends is checked before anything is allocated or indexed for it (wire.h:
// ids, descriptions, sizes against max_tensor_bytes, lane boundaries, the last joiner's rank); a
// violation is a protocol error that fails this rank's data plane, naming the field.
//
// Errors: a run order that cannot run (a mismatch, a stall past the shutdown time) fails only its
// ticket. A failure of this rank's data plane (seen within 100 ms), a lost coordinator or a dead
// or failed rank fails every ticket on every rank: nothing waits for ever on a rank that is gone
// or that has stopped submitting because its collectives failed.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "negotiation/wire.h"
#include "proxy/client.h"
#include "shm/segment.h"
#include "transport/socket.h"

namespace fasthorovod {

struct MemberOptions {
  uint32_t rank = 0;
  uint32_t size = 1;
  std::string token;
  std::string coordinator_host;
  int coordinator_port = 0;
  double timeout_seconds = 120.0;
  uint64_t max_tensor_bytes = DefaultMaxTensorBytes();  // the largest run order (zero buffer) accepted
};

class Member {
 public:
  static Status Start(ProxyChannel* channel, const MemberOptions& options, std::unique_ptr<Member>* out);
  ~Member();

  // Numbers the tickets of this member from `first` on; only before its first ticket (else
  // kInvalidArgument). Without it they start at 0.
  Status NumberTicketsFrom(uint64_t first);
  // Files `request` (name, dtype, op, count, scale factors, hashes, buffer; its lane boundaries
  // are the run order's) under its name; `shape` is for error messages. Returns a ticket. A name
  // already registered (see above) fails with kInvalidArgument: "Requested to allreduce a tensor
  // with the same name as another tensor that is currently being processed: 'NAME'" (broadcast
  // for OP_BROADCAST, allgather for OP_GATHER).
  Status Submit(const RequestDesc& request, const std::string& shape, uint64_t* ticket);
  // Whether `name` (cut as a request's name is, to kNameBytes - 1) is in flight: what Submit would
  // refuse. For collectives that take the name before they submit (an allgather's or alltoall's
  // heads travel first), so that they refuse it when called, as Horovod does.
  bool Holds(const std::string& name);
  // The lane weights of the collectives this rank submits from now on (one per lane, each finite
  // and > 0; else kInvalidArgument). Ranks need not agree: the lead rank's decide.
  Status SetLaneWeights(const std::vector<double>& weights);
  // This rank joins: the ticket completes when every rank has joined, with the last one.
  Status Join(uint64_t* ticket);
  bool Poll(uint64_t ticket);
  // Why this rank's data plane is broken (a failure here, another rank's, the coordinator gone), or
  // Ok: for waits outside the negotiation (the heads of a two-stage collective travel through
  // Horovod, which has no timeout), so that they end when the data plane has failed.
  Status Broken();
  // Waits for the ticket: for its turn (until it runs, or a failure anywhere fails it), then for its collective
  // (FASTHOROVOD_TIMEOUT_SECONDS of no progress). *last_joined is set for join tickets.
  Status Wait(uint64_t ticket, double timeout_seconds, int64_t* last_joined);
  // Says goodbye to the coordinator and stops the thread (idempotent).
  void Close();

 private:
  struct Ticket {
    RequestDesc request;
    WireDesc desc;
    bool join = false;
    bool announced = false;  // sent to the coordinator: a run order or an error of its name is for it
    bool posted = false;   // request.seq is valid
    bool finished = false; // join done, or failed before posting
    bool waiting = false;  // a Wait has taken it (consumed once that returns)
    Status status;
    int64_t last_joined = -1;
  };
  // What the thread sends next, in order: a submitted ticket's announcement or new lane weights.
  struct Outgoing {
    uint64_t ticket = 0;
    std::vector<double> weights;  // non-empty: a kWeights
  };
  struct ZeroBuffer {
    ShmSegment segment;
    uint32_t id = 0;
    bool busy = false;
    uint64_t seq = 0;
  };

  Member(ProxyChannel* channel, const MemberOptions& options) : channel_(channel), opt_(options) {}
  void Run();
  Status Serve();
  Status Announce();
  Status Respond(const std::string& payload);
  Status RunOrder(uint32_t id, const std::vector<uint64_t>& bounds);
  void Release(uint64_t ticket);  // frees its name if it still holds it (mu_ held)
  Status PostZeros(const WireDesc& desc, const std::vector<uint64_t>& bounds);
  void ReapZeros();
  void FailAll(const Status& why);
  void Wake();

  ProxyChannel* channel_;
  MemberOptions opt_;
  Socket sock_;
  int wake_fd_ = -1;  // eventfd: new submissions for the thread to announce
  std::thread thread_;

  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_ticket_ = 0;
  bool numbered_ = false;                              // a ticket was filed: the numbering is fixed
  std::unordered_map<uint64_t, Ticket> tickets_;
  std::unordered_map<std::string, uint64_t> by_name_;  // names in flight: submitted, not yet consumed
  std::deque<Outgoing> outbox_;                        // to announce, in order
  bool join_requested_ = false;                        // a kJoin to send
  bool joined_ = false;
  bool join_recorded_ = false;                         // the coordinator acknowledged this rank's join (kJoined)
  uint64_t join_ticket_ = 0;
  bool stopping_ = false;
  Status broken_;
  // The response cache, as the coordinator last described each id.
  std::vector<WireDesc> by_id_;
  std::unordered_map<std::string, uint32_t> id_of_;
  std::vector<std::unique_ptr<ZeroBuffer>> zeros_;  // thread only
  int64_t last_health_check_ns_ = 0;                 // thread only
};

}  // namespace fasthorovod
