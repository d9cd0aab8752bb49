#include "negotiation/member.h"

#include <chrono>

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "collectives/reduce.h"
#include "common/collective.h"
#include "common/clock.h"

namespace fasthorovod {
namespace {

constexpr uint32_t kZeroBufferIds = 0x80000000u;  // the worker's Python buffer pool counts up from 0
constexpr int64_t kHealthCheckNs = 100'000'000;    // how often the thread looks at the channel

// Horovod's word for the collective a request is (its duplicate-name message names it).
const char* Verb(uint32_t op) {
  if (op == static_cast<uint32_t>(ReduceOp::kBroadcast)) return "broadcast";
  if (op == static_cast<uint32_t>(ReduceOp::kGather)) return "allgather";
  if (op == static_cast<uint32_t>(ReduceOp::kReduceScatter)) return "reducescatter";
  if (op == static_cast<uint32_t>(ReduceOp::kAlltoall)) return "alltoall";
  return "allreduce";
}

}  // namespace

Status Member::Start(ProxyChannel* channel, const MemberOptions& options, std::unique_ptr<Member>* out) {
  if (options.token.size() != kTokenBytes) return Status::Error(Code::kInvalidArgument, "job token must be 16 bytes");
  std::unique_ptr<Member> m(new Member(channel, options));
  m->wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (m->wake_fd_ < 0) return Status::Error(Code::kIoError, "eventfd(): " + ErrnoString(errno));
  const std::string who = Str("the coordinator (rank 0 at ", options.coordinator_host, ":", options.coordinator_port, ")");
  Deadline deadline = Deadline::After(options.timeout_seconds);
  FHVD_RETURN_IF_ERROR(ConnectWithRetry(options.coordinator_host, options.coordinator_port, deadline, &m->sock_));
  EnableLiveness(m->sock_.fd(), options.timeout_seconds);  // the coordinator's host could vanish while we wait
  LinkIdentity self;  // lane, config hash: 0 (the coordinator has neither)
  std::memcpy(self.token, options.token.data(), kTokenBytes);
  self.rank = options.rank;
  self.size = options.size;
  FHVD_RETURN_IF_ERROR(AuthenticateToPeer(m->sock_.fd(), self, LinkPurpose::kNegotiation, 0, 0, deadline, who));
  // Start-up is collective: no rank goes on (to a collective, or to shutting down a data plane
  // another rank is still joining) before every rank is connected.
  // The coordinator gives up timeout_seconds after the first rank came in and says so: wait longer.
  MsgType type;
  std::string payload;
  Status st = RecvFrame(m->sock_.fd(), Deadline::After(2 * options.timeout_seconds), who, &type, &payload);
  if (!st.ok()) {
    return Status::Error(st.code() == Code::kTimeout ? Code::kTimeout : Code::kPeerError,
                         Str("waiting for every rank to connect to ", who, ": ", st.message()));
  }
  if (type == MsgType::kFailed) {
    WireReader in(payload);
    const Code code = CodeFromPeer(CodeFromWire(in.U32()));
    return Status::Error(code, Str(who, " failed: ", in.Text()));
  }
  if (type != MsgType::kWelcome) {
    return Status::Error(Code::kIoError, Str("protocol error: ", who, " sent message type ",
                                             static_cast<uint32_t>(type), " before its welcome"));
  }
  // The coordinator cuts this rank's collectives by its lane weights: equal until SetLaneWeights.
  WireWriter weights;
  weights.F64s(std::vector<double>(channel->num_lanes(), 1.0));
  FHVD_RETURN_IF_ERROR(SendFrame(m->sock_.fd(), weights.Frame(MsgType::kWeights),
                                 Deadline::After(options.timeout_seconds), who));
  m->thread_ = std::thread([p = m.get()] { p->Run(); });
  *out = std::move(m);
  return Status::Ok();
}

Member::~Member() {
  Close();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void Member::Close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  Wake();
  if (thread_.joinable()) thread_.join();
  if (sock_.valid()) {
    WireWriter bye;
    SendFrame(sock_.fd(), bye.Frame(MsgType::kBye), Deadline::After(1.0), "the coordinator");
    sock_.Close();
  }
  FailAll(Status::Error(Code::kAborted, Str("rank ", opt_.rank, " shut down its data plane")));
}

void Member::Wake() {
  uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
}

Status Member::NumberTicketsFrom(uint64_t first) {
  std::lock_guard<std::mutex> lock(mu_);
  if (numbered_) {
    return Status::Error(Code::kInvalidArgument, Str("tickets are numbered from ", next_ticket_,
                                                     " already: a ticket has been filed"));
  }
  next_ticket_ = first;
  return Status::Ok();
}

bool Member::Holds(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  return by_name_.count(name.substr(0, kNameBytes - 1)) != 0;
}

Status Member::Submit(const RequestDesc& request, const std::string& shape, uint64_t* ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!broken_.ok()) return broken_;
  if (stopping_) return Status::Error(Code::kAborted, "the data plane is shut down");
  const std::string name(request.name, strnlen(request.name, kNameBytes));
  if (by_name_.count(name)) {  // Horovod's message, word for word
    return Status::Error(Code::kInvalidArgument,
                         Str("Requested to ", Verb(request.op), " a tensor with the same name as another tensor "
                             "that is currently being processed: '", name, "'"));
  }
  Ticket t;
  t.request = request;
  t.desc.name = name;
  t.desc.shape = shape;
  t.desc.dtype = request.dtype;
  t.desc.op = request.op;
  t.desc.count = request.count;
  t.desc.name_hash = request.name_hash;
  t.desc.shape_hash = request.shape_hash;
  t.desc.prescale = request.prescale;
  t.desc.postscale = request.postscale;
  t.request.num_lanes = 0;  // the run order's boundaries, set when it is posted
  *ticket = next_ticket_++;
  numbered_ = true;
  t.request.trace_id = *ticket;
  tickets_.emplace(*ticket, std::move(t));
  by_name_[name] = *ticket;
  outbox_.push_back(Outgoing{*ticket, {}});
  Wake();
  return Status::Ok();
}

Status Member::SetLaneWeights(const std::vector<double>& weights) {
  const std::string problem = LaneWeightsProblem(weights, channel_->num_lanes());
  if (!problem.empty()) {
    return Status::Error(Code::kInvalidArgument, Str("lane weights must be ", channel_->num_lanes(),
                                                     " finite numbers > 0, one per lane; got ", problem));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!broken_.ok()) return broken_;
  if (stopping_) return Status::Error(Code::kAborted, "the data plane is shut down");
  if (!outbox_.empty() && !outbox_.back().weights.empty()) {
    outbox_.back().weights = weights;  // nothing submitted since the last change: it never applied
  } else {
    outbox_.push_back(Outgoing{0, weights});
  }
  Wake();
  return Status::Ok();
}

Status Member::Join(uint64_t* ticket) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!broken_.ok()) return broken_;
  if (joined_ || join_requested_) return Status::Error(Code::kInvalidArgument, "this rank has already joined");
  Ticket t;
  t.join = true;
  *ticket = next_ticket_++;
  numbered_ = true;
  tickets_.emplace(*ticket, std::move(t));
  join_ticket_ = *ticket;
  join_requested_ = true;
  join_recorded_ = false;
  Wake();
  // Returns once the coordinator has recorded the join (kJoined): whatever this rank does next
  // (Horovod's own join, which lets the other ranks' collectives complete and so their joins
  // begin) comes after it, and the last rank to join is the last one to call hvd.join().
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(opt_.timeout_seconds);
  if (!cv_.wait_until(lock, deadline, [&] { return join_recorded_ || !broken_.ok() || stopping_; })) {
    return Status::Error(Code::kTimeout, Str("the coordinator did not record rank ", opt_.rank, "'s join within ",
                                             opt_.timeout_seconds, " s"));
  }
  if (!broken_.ok()) return broken_;
  if (stopping_) return Status::Error(Code::kAborted, "the data plane is shut down");
  return Status::Ok();
}

Status Member::Broken() {
  std::lock_guard<std::mutex> lock(mu_);
  return broken_;
}

bool Member::Poll(uint64_t ticket) {
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = tickets_.find(ticket);
    if (it == tickets_.end()) return true;
    if (it->second.finished) return true;
    if (!it->second.posted) return false;
    seq = it->second.request.seq;
  }
  return channel_->Poll(seq);
}

Status Member::Wait(uint64_t ticket, double timeout_seconds, int64_t* last_joined) {
  uint64_t seq;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = tickets_.find(ticket);
    if (it == tickets_.end() || it->second.waiting) {
      return Status::Error(Code::kInvalidArgument, Str("unknown or finished ticket ", ticket));
    }
    Ticket& t = it->second;  // stays valid while other tickets come and go (an iterator would not)
    t.waiting = true;
    // Waiting for the other ranks to submit has no time limit of its own (Horovod's semantics; the
    // stall inspector reports it), but any failure ends it: of this rank's data plane (the member's
    // thread checks it every 100 ms), of another rank or of the coordinator (FailAll).
    cv_.wait(lock, [&] { return t.posted || t.finished; });
    if (t.finished) {
      Status st = t.status;
      if (last_joined != nullptr) *last_joined = t.last_joined;
      Release(ticket);
      tickets_.erase(ticket);
      return st;
    }
    seq = t.request.seq;
  }
  Status st = channel_->Wait(seq, timeout_seconds);
  // Consumed: its name is free again (Horovod's rule: from the synchronize on).
  std::lock_guard<std::mutex> lock(mu_);
  Release(ticket);
  tickets_.erase(ticket);
  return st;
}

void Member::Release(uint64_t ticket) {
  auto t = tickets_.find(ticket);
  if (t == tickets_.end()) return;
  auto named = by_name_.find(t->second.desc.name);
  if (named != by_name_.end() && named->second == ticket) by_name_.erase(named);
}

void Member::FailAll(const Status& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (broken_.ok()) broken_ = why;
  for (auto& [id, t] : tickets_) {
    if (!t.posted && !t.finished) {
      t.finished = true;
      t.status = broken_;
    }
  }
  by_name_.clear();
  outbox_.clear();
  cv_.notify_all();
}

void Member::Run() {
  Status st = Serve();
  if (!st.ok()) FailAll(st);
}

Status Member::Serve() {
  const std::string who = "the coordinator (rank 0)";
  pollfd fds[2];
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return Status::Ok();
    }
    fds[0] = {sock_.fd(), POLLIN, 0};
    fds[1] = {wake_fd_, POLLIN, 0};
    int rc = poll(fds, 2, 100);
    if (rc < 0 && errno != EINTR) return Status::Error(Code::kIoError, "poll(): " + ErrnoString(errno));
    if (fds[1].revents != 0) {
      uint64_t n;
      (void)!::read(wake_fd_, &n, sizeof(n));
    }
    // A failure of this rank's data plane ends the job for every rank: the others may be waiting for
    // collectives this rank will never submit, so the coordinator tells them all. Checked every
    // 100 ms, not on every wake-up (submissions wake the thread, and the check costs syscalls).
    const int64_t now = NowNs();
    Status health;
    if (now - last_health_check_ns_ >= kHealthCheckNs) {
      last_health_check_ns_ = now;
      health = channel_->Health();
    }
    if (!health.ok()) {
      WireWriter w;
      w.U32(static_cast<uint32_t>(health.code()));
      w.Text(health.message());
      SendFrame(sock_.fd(), w.Frame(MsgType::kBroken), Deadline::After(2.0), who);
      return health;
    }
    FHVD_RETURN_IF_ERROR(Announce());
    if (fds[0].revents != 0) {
      MsgType type;
      std::string payload;
      Status st = RecvFrame(sock_.fd(), Deadline::After(opt_.timeout_seconds), who, &type, &payload);
      if (!st.ok()) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (stopping_) return Status::Ok();
        }
        return Status::Error(Code::kPeerError, Str("lost the coordinator (rank 0): ", st.message()));
      }
      if (type == MsgType::kFailed) {
        WireReader in(payload);
        Code code = CodeFromPeer(CodeFromWire(in.U32()));
        const Status cause = channel_->RootCause(Status::Error(code, in.Text()));
        // The job failed: collectives already with the proxies may wait for a peer that will never
        // come (an alltoall's mesh still connecting to a rank whose proxy died), so they fail now,
        // with the cause, rather than at their timeout.
        channel_->Break(cause);
        return cause;
      }
      if (type != MsgType::kResponses) {
        return Status::Error(Code::kIoError, Str("protocol error: the coordinator sent message type ",
                                                 static_cast<uint32_t>(type)));
      }
      FHVD_RETURN_IF_ERROR(Respond(payload));
    }
    ReapZeros();
  }
}

Status Member::Announce() {
  // One kAnnounce per run of submissions, a kWeights between two runs where the weights changed.
  std::vector<std::string> frames;
  {
    std::lock_guard<std::mutex> lock(mu_);
    WireWriter entries;
    uint32_t n = 0;
    auto flush = [&] {
      if (n == 0) return;
      WireWriter w;
      w.U32(n);
      w.Bytes(entries.body());
      frames.push_back(w.Frame(MsgType::kAnnounce));
      entries.Clear();
      n = 0;
    };
    for (const Outgoing& out : outbox_) {
      if (!out.weights.empty()) {
        flush();
        WireWriter w;
        w.F64s(out.weights);
        frames.push_back(w.Frame(MsgType::kWeights));
        continue;
      }
      auto it = tickets_.find(out.ticket);
      if (it == tickets_.end() || it->second.finished) continue;  // failed before its announcement
      Ticket& t = it->second;
      t.announced = true;
      auto cached = id_of_.find(t.desc.name);
      if (cached != id_of_.end() && by_id_[cached->second] == t.desc) {
        entries.U8(1);
        entries.U32(cached->second);
      } else {
        entries.U8(0);
        entries.Desc(t.desc);
      }
      ++n;
    }
    flush();
    outbox_.clear();
    if (join_requested_) {
      join_requested_ = false;
      joined_ = true;
      frames.push_back(WireWriter().Frame(MsgType::kJoin));
    }
  }
  Deadline deadline = Deadline::After(opt_.timeout_seconds);
  for (const std::string& frame : frames) FHVD_RETURN_IF_ERROR(SendFrame(sock_.fd(), frame, deadline, "the coordinator"));
  return Status::Ok();
}

Status Member::Respond(const std::string& payload) {
  const std::string who = "the coordinator (rank 0)";
  WireReader in(payload);
  const uint32_t n = in.U32();
  for (uint32_t i = 0; i < n && in.ok(); ++i) {
    switch (static_cast<ResponseType>(in.U8())) {
      case ResponseType::kRun: {
        const uint32_t id = in.U32();
        if (in.U8() != 0) {
          WireDesc desc = in.Desc();
          if (!in.ok()) break;
          // Ids are handed out in order: a new one is the next, never a jump (which would size the cache).
          if (id > by_id_.size()) {
            return Status::Error(Code::kIoError, Str("protocol error: ", who, " described id ", id, " while ",
                                                     by_id_.size(), " ids are known (the next is ", by_id_.size(), ")"));
          }
          FHVD_RETURN_IF_ERROR(CheckWireDesc(desc, opt_.max_tensor_bytes, who));
          if (id == by_id_.size()) by_id_.emplace_back();
          id_of_[desc.name] = id;
          by_id_[id] = std::move(desc);
        }
        std::vector<uint64_t> bounds = in.U64s();
        if (!in.ok()) break;
        if (id >= by_id_.size()) {
          return Status::Error(Code::kIoError, Str("protocol error: ", who, " ran unknown id ", id, " (",
                                                   by_id_.size(), " known)"));
        }
        FHVD_RETURN_IF_ERROR(CheckLaneBounds(bounds, by_id_[id].count, channel_->num_lanes(), by_id_[id].name, who));
        FHVD_RETURN_IF_ERROR(RunOrder(id, bounds));
        break;
      }
      case ResponseType::kError: {
        std::string name = in.Text();
        Code code = CodeFromWire(in.U32());
        std::string message = in.Text();
        if (!in.ok()) break;
        std::lock_guard<std::mutex> lock(mu_);
        // Only a ticket the coordinator knows of fails: announced, not yet run (a posted one of the
        // name is an earlier collective, an unannounced one a later one).
        auto it = by_name_.find(name);
        if (it != by_name_.end()) {
          Ticket& t = tickets_.at(it->second);
          if (t.announced && !t.posted && !t.finished) {
            t.finished = true;
            t.status = Status::Error(code, message);
            by_name_.erase(it);  // failed: the name is free again
            cv_.notify_all();
          }
        }
        break;
      }
      case ResponseType::kJoined: {
        const uint32_t rank = in.U32();
        if (!in.ok()) break;
        if (rank >= opt_.size) {
          return Status::Error(Code::kIoError, Str("protocol error: ", who, " recorded the join of rank ", rank, ", of ",
                                                   opt_.size, " ranks"));
        }
        if (rank == opt_.rank) {
          std::lock_guard<std::mutex> lock(mu_);
          join_recorded_ = true;
          cv_.notify_all();
        }
        break;
      }
      case ResponseType::kJoinDone: {
        const uint32_t last = in.U32();
        if (!in.ok()) break;
        if (last >= opt_.size) {
          return Status::Error(Code::kIoError, Str("protocol error: ", who, " named rank ", last,
                                                   " the last to join, of ", opt_.size, " ranks"));
        }
        std::lock_guard<std::mutex> lock(mu_);
        joined_ = false;
        auto it = tickets_.find(join_ticket_);
        if (it != tickets_.end()) {
          it->second.finished = true;
          it->second.last_joined = last;
          cv_.notify_all();
        }
        break;
      }
      default:
        if (!in.ok()) break;
        return Status::Error(Code::kIoError, Str("protocol error: ", who, " sent an unknown response type"));
    }
  }
  if (!in.ok() || !in.done()) {
    return Status::Error(Code::kIoError, Str("protocol error: malformed response batch from ", who,
                                             in.ok() ? " (bytes after its last entry)" : " (cut short)"));
  }
  return Status::Ok();
}

Status Member::RunOrder(uint32_t id, const std::vector<uint64_t>& bounds) {
  const WireDesc& desc = by_id_[id];
  if (bounds.size() != channel_->num_lanes() + 1) {
    return Status::Error(Code::kIoError, Str("protocol error: ", bounds.size(), " lane boundaries for ",
                                             channel_->num_lanes(), " lanes"));
  }
  RequestDesc request;
  uint64_t ticket = 0;
  bool mine = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // This rank's collective of the name: announced and not yet run. A posted one not yet waited on
    // is an earlier collective of the name, so this one is not this rank's (it has joined).
    auto it = by_name_.find(desc.name);
    const Ticket* t = it != by_name_.end() ? &tickets_.at(it->second) : nullptr;
    if (t != nullptr && t->announced && !t->posted && !t->finished) {
      mine = true;
      ticket = it->second;
      request = t->request;
    } else if (!joined_) {
      return Status::Error(Code::kIoError, Str("protocol error: the coordinator ran tensor '", desc.name,
                                               "', which rank ", opt_.rank, " neither submitted nor joined for"));
    }
  }
  if (!mine) return PostZeros(desc, bounds);
  if (desc.count != request.count) {  // the coordinator ran another description under this rank's name
    return Status::Error(Code::kIoError, Str("protocol error: the coordinator ran tensor '", desc.name, "' with ",
                                             desc.count, " elements; rank ", opt_.rank, " submitted ", request.count));
  }
  // The coordinator's boundaries, for an allgather too (it computes the row layout gather.py used).
  request.num_lanes = static_cast<uint32_t>(bounds.size() - 1);
  std::copy(bounds.begin(), bounds.end(), request.lane_begin);
  uint64_t seq = 0;
  Status st = channel_->Post(request, &seq);
  std::lock_guard<std::mutex> lock(mu_);
  Ticket& t = tickets_.at(ticket);
  if (st.ok()) {
    t.request.seq = seq;
    t.posted = true;
  } else {
    t.finished = true;
    t.status = st;
    Release(ticket);
  }
  cv_.notify_all();
  return Status::Ok();
}

// This rank has joined: it takes part in `desc` with zeros (for an allgather, with a zero row).
Status Member::PostZeros(const WireDesc& desc, const std::vector<uint64_t>& bounds) {
  const size_t elem = DTypeValid(desc.dtype) ? DTypeSize(static_cast<DType>(desc.dtype)) : 0;
  if (elem == 0) return Status::Error(Code::kIoError, "protocol error: bad dtype in a run order");
  // Respond checked desc (CheckWireDesc: count x elem <= max_tensor_bytes) and the boundaries.
  const size_t bytes = std::max<size_t>(1, desc.count * elem);
  ZeroBuffer* zero = nullptr;
  for (auto& z : zeros_) {
    if (!z->busy && z->segment.size() >= bytes) zero = z.get();
  }
  if (zero == nullptr) {
    auto z = std::make_unique<ZeroBuffer>();
    z->id = kZeroBufferIds + static_cast<uint32_t>(zeros_.size());
    FHVD_RETURN_IF_ERROR(channel_->CreateBuffer(z->id, bytes, &z->segment));
    zeros_.push_back(std::move(z));
    zero = zeros_.back().get();
  }
  std::memset(zero->segment.data(), 0, bytes);
  RequestDesc request;
  request.kind = static_cast<uint32_t>(RequestKind::kAllreduce);
  request.dtype = desc.dtype;
  request.op = desc.op;
  request.buffer_id = zero->id;
  request.count = desc.count;
  request.name_hash = desc.name_hash;
  request.shape_hash = desc.shape_hash;
  request.prescale = desc.prescale;
  request.postscale = desc.postscale;
  request.num_lanes = static_cast<uint32_t>(bounds.size() - 1);
  request.flags = kRequestZeroFill;
  std::copy(bounds.begin(), bounds.end(), request.lane_begin);
  CopyString(request.name, desc.name);
  // A failure here breaks the channel; this rank's next wait reports it.
  if (channel_->Post(request, &zero->seq).ok()) zero->busy = true;
  return Status::Ok();
}

void Member::ReapZeros() {
  for (auto& z : zeros_) {
    if (z->busy && channel_->Poll(z->seq)) {
      (void)channel_->Wait(z->seq, opt_.timeout_seconds);  // consumes the result (an error stays in the channel)
      z->busy = false;
    }
  }
}

}  // namespace fasthorovod
