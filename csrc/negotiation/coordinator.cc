#include "negotiation/coordinator.h"

#include <poll.h>

#include <algorithm>
#include <cstdio>

#include "common/clock.h"
#include "common/collective.h"

namespace fasthorovod {
namespace {

constexpr size_t kMaxReportedMessage = 4096;  // of a member's kBroken message, passed on to every rank
constexpr double kFirstMemberTimeouts = 3.0;   // the first member arrives within this many timeouts

std::string RankList(const std::vector<uint32_t>& ranks) {
  std::string out = "[";
  for (size_t i = 0; i < ranks.size(); ++i) out += Str(i ? ", " : "", ranks[i]);
  return out + "]";
}

// What Horovod calls a collective of `op` that a joined rank cannot take part in (its zeros would
// be rows of the result, or the root), or nullptr for an allreduce, which joined ranks pad with zeros.
const char* WithoutJoin(uint32_t op) {
  switch (static_cast<ReduceOp>(op)) {
    case ReduceOp::kBroadcast: return "Broadcast";
    case ReduceOp::kGather: return "Allgather";
    case ReduceOp::kReduceScatter: return "Reducescatter";
    case ReduceOp::kAlltoall: return "Alltoall";
    default: return nullptr;
  }
}

// The first field in which the submitters' descriptions differ, with each rank's value.
std::string Disagreement(const std::vector<uint32_t>& ranks, const std::vector<WireDesc>& desc) {
  struct Field {
    const char* what;
    std::string (*show)(const WireDesc&);
  };
  static const Field kFields[] = {
      {"shape", [](const WireDesc& d) { return Str("[", d.shape, "]"); }},
      {"shape hash", [](const WireDesc& d) { return Str(d.shape_hash); }},
      {"number of elements", [](const WireDesc& d) { return Str(d.count); }},
      {"dtype", [](const WireDesc& d) { return Str("dtype code ", d.dtype); }},
      {"op", [](const WireDesc& d) { return Str("op code ", d.op); }},
      {"prescale factor", [](const WireDesc& d) { return Str(d.prescale); }},
      {"postscale factor", [](const WireDesc& d) { return Str(d.postscale); }},
  };
  for (const Field& f : kFields) {
    std::string first = f.show(desc[ranks[0]]);
    bool differs = false;
    for (uint32_t r : ranks) differs |= f.show(desc[r]) != first;
    if (!differs) continue;
    std::string values;
    for (uint32_t r : ranks) values += Str(values.empty() ? "" : ", ", "rank ", r, ": ", f.show(desc[r]));
    return Str(f.what, " (", values, ")");
  }
  return "its description";
}

}  // namespace

Status Coordinator::Start(const CoordinatorOptions& options, std::unique_ptr<Coordinator>* out, int* port) {
  if (options.size == 0) return Status::Error(Code::kInvalidArgument, "coordinator needs size >= 1");
  if (options.token.size() != kTokenBytes) return Status::Error(Code::kInvalidArgument, "job token must be 16 bytes");
  std::unique_ptr<Coordinator> c(new Coordinator(options));
  FHVD_RETURN_IF_ERROR(Listen(options.bind_host, 0, &c->listener_, port));
  c->members_.resize(options.size);
  c->joined_.assign(options.size, false);
  c->gone_.assign(options.size, false);
  c->weights_.resize(options.size);
  c->thread_ = std::thread([p = c.get()] { p->Run(); });
  *out = std::move(c);
  return Status::Ok();
}

Coordinator::~Coordinator() { Stop(); }

void Coordinator::Stop() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
  for (auto& m : members_) m.Close();
  listener_.Close();
}

std::string Coordinator::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void Coordinator::Run() {
  Status st = Serve();
  // A member that arrives late must not sit in the listen queue until Stop(): it is refused now
  // and its own connect deadline reports it.
  listener_.Close();
  if (!st.ok() && !stop_.load()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      error_ = st.message();
    }
    WireWriter w;
    w.U32(static_cast<uint32_t>(st.code()));
    w.Text(st.message());
    Broadcast(MsgType::kFailed, w.body());
  }
}

Status Coordinator::AcceptMembers() {
  // The ranks reach their members after exchanging addresses and connecting their rings, which can
  // take a while on a loaded host: the window of timeout_seconds opens when the first member is in
  // (the others are then at most one ring set-up behind), within an outer bound from creation.
  Deadline deadline = Deadline::After(kFirstMemberTimeouts * opt_.timeout_seconds);
  uint32_t connected = 0;
  // Every member proves the job token (transport's handshake, LinkPurpose::kNegotiation); pending
  // connections progress together, so strangers cannot hold the members up.
  HandshakeAcceptor acceptor(listener_, opt_.token.data(), 0, "coordinator");
  auto refuse = [&](const PeerClaim& claim) -> std::string {
    if (claim.purpose != LinkPurpose::kNegotiation) return "not a negotiation connection";
    if (claim.size != opt_.size) return Str("world size ", claim.size, " != ", opt_.size);
    if (claim.rank >= opt_.size) return Str("rank ", claim.rank, " out of range");
    if (members_[claim.rank].valid()) return Str("rank ", claim.rank, " is already connected");
    return "";
  };
  auto take = [&](const PeerClaim& claim, Socket sock) {
    EnableLiveness(sock.fd(), opt_.timeout_seconds);  // a rank may stay silent for long; a vanished one is an error
    members_[claim.rank] = std::move(sock);
    if (connected++ == 0) deadline = Deadline::After(opt_.timeout_seconds);
  };
  while (connected < opt_.size) {
    if (stop_.load()) return Status::Ok();
    if (deadline.Expired()) {
      std::vector<uint32_t> missing;
      for (uint32_t r = 0; r < opt_.size; ++r) {
        if (!members_[r].valid()) missing.push_back(r);
      }
      return Status::Error(Code::kTimeout,
                           Str("only ", connected, " of ", opt_.size, " ranks connected to the coordinator within ",
                               connected == 0 ? kFirstMemberTimeouts * opt_.timeout_seconds : opt_.timeout_seconds,
                               " s", connected == 0 ? " of its start" : " of the first one",
                               " (missing: ", RankList(missing), ")"));
    }
    FHVD_RETURN_IF_ERROR(acceptor.Step(200, refuse, take));
  }
  return Status::Ok();
}

Status Coordinator::Serve() {
  FHVD_RETURN_IF_ERROR(AcceptMembers());
  listener_.Close();
  Broadcast(MsgType::kWelcome, "");
  std::vector<pollfd> fds(opt_.size);
  while (!stop_.load()) {
    uint32_t live = 0;
    for (uint32_t r = 0; r < opt_.size; ++r) {
      fds[r] = {members_[r].valid() ? members_[r].fd() : -1, POLLIN, 0};
      live += members_[r].valid();
    }
    if (live == 0) return Status::Ok();  // everyone said goodbye
    int rc = poll(fds.data(), fds.size(), 200);
    if (rc < 0 && errno != EINTR) return Status::Error(Code::kIoError, "poll(): " + ErrnoString(errno));
    for (uint32_t r = 0; r < opt_.size && rc > 0; ++r) {
      if (fds[r].fd < 0 || fds[r].revents == 0) continue;
      MsgType type;
      std::string payload;
      bool broken_protocol = false;
      Status st = RecvFrame(members_[r].fd(), Deadline::After(opt_.timeout_seconds), Str("rank ", r), &type, &payload,
                            &broken_protocol);
      if (!st.ok() && broken_protocol) {
        return Status::Error(Code::kPeerError, Str("rank ", r, " broke the negotiation protocol: ", st.message()));
      }
      if (!st.ok()) {
        return Status::Error(Code::kPeerError, Str("rank ", r, " disconnected from the negotiation's coordinator "
                                                   "without shutting down (its worker died or failed): ",
                                                   st.message()));
      }
      FHVD_RETURN_IF_ERROR(Handle(r, type, payload));
    }
    Settle();
    CheckStalls();
    FHVD_RETURN_IF_ERROR(Flush());
  }
  return Status::Ok();
}

Status Coordinator::Handle(uint32_t rank, MsgType type, const std::string& payload) {
  WireReader in(payload);
  switch (type) {
    case MsgType::kAnnounce:
      return Announce(rank, in);
    case MsgType::kWeights:
      return SetWeights(rank, in);
    case MsgType::kJoin:
      Join(rank);
      return Status::Ok();
    case MsgType::kBye:
      Leave(rank);
      return Status::Ok();
    case MsgType::kBroken: {
      const Code code = CodeFromPeer(CodeFromWire(in.U32()));
      const std::string why = in.Text();
      return Status::Error(code, Str("rank ", rank, " failed: ", why.substr(0, kMaxReportedMessage)));
    }
    default:
      return Status::Error(Code::kIoError, Str("protocol error: rank ", rank, " sent message type ",
                                               static_cast<uint32_t>(type)));
  }
}

Status Coordinator::Announce(uint32_t rank, WireReader& in) {
  const std::string who = Str("rank ", rank);
  const uint32_t n = in.U32();
  for (uint32_t i = 0; i < n && in.ok(); ++i) {
    WireDesc desc;
    const uint8_t cached = in.U8();
    if (cached > 1) return Status::Error(Code::kIoError, Str("protocol error: ", who, " sent entry kind ", uint32_t{cached}));
    if (cached != 0) {
      const uint32_t id = in.U32();
      if (!in.ok()) break;
      if (id >= by_id_.size()) {
        return Status::Error(Code::kIoError, Str("protocol error: ", who, " used unknown id ", id, " (", by_id_.size(),
                                                 " known)"));
      }
      desc = by_id_[id];
    } else {
      desc = in.Desc();
      if (!in.ok()) break;
      FHVD_RETURN_IF_ERROR(CheckWireDesc(desc, opt_.max_tensor_bytes, who));
      // An allgather or reduce-scatter of `size` rows: its boundaries are size x those of one row (Finish).
      if (RowsPerRank(desc.op) && desc.count % opt_.size != 0) {
        const char* kind = desc.op == static_cast<uint32_t>(ReduceOp::kGather) ? "allgather" : "reducescatter";
        return Status::Error(Code::kIoError, Str("protocol error: ", who, " described ", kind, " '", desc.name,
                                                 "' with count ", desc.count, " (not a multiple of the ", opt_.size,
                                                 " ranks' rows)"));
      }
    }
    if (weights_[rank] == nullptr) {
      return Status::Error(Code::kIoError, Str("protocol error: ", who, " announced tensor '", desc.name,
                                               "' before its lane weights"));
    }
    FHVD_RETURN_IF_ERROR(Submit(rank, std::move(desc)));
  }
  if (!in.ok() || !in.done()) {
    return Status::Error(Code::kIoError, Str("protocol error: malformed announcement from ", who,
                                             in.ok() ? " (bytes after its last entry)" : " (cut short)"));
  }
  return Status::Ok();
}

Status Coordinator::SetWeights(uint32_t rank, WireReader& in) {
  std::vector<double> weights = in.F64s();
  if (!in.ok() || !in.done()) {
    return Status::Error(Code::kIoError, Str("protocol error: malformed lane weights from rank ", rank,
                                             in.ok() ? " (bytes after the last)" : " (cut short)"));
  }
  // A rank's lanes are fixed at start-up; its first weights say how many it runs.
  const uint32_t lanes = weights_[rank] != nullptr ? static_cast<uint32_t>(weights_[rank]->size()) : 0;
  const std::string problem = LaneWeightsProblem(weights, lanes);
  if (!problem.empty()) {
    return Status::Error(Code::kIoError, Str("protocol error: rank ", rank, " sent lane weights with ", problem));
  }
  weights_[rank] = std::make_shared<const std::vector<double>>(std::move(weights));
  return Status::Ok();
}

Status Coordinator::Submit(uint32_t rank, WireDesc desc) {
  auto it = pending_.find(desc.name);
  if (it == pending_.end()) {
    if (pending_.size() >= kMaxPendingCollectives) {
      return Status::Error(Code::kIoError, Str("protocol error: rank ", rank, " submitted tensor '", desc.name,
                                               "' while ", pending_.size(), " collectives wait for other ranks (at most ",
                                               kMaxPendingCollectives, ")"));
    }
    Pending p;
    p.name = desc.name;
    p.submitted.assign(opt_.size, false);
    p.desc.resize(opt_.size);
    p.weights.resize(opt_.size);
    p.first_ns = NowNs();
    p.arrival = arrivals_++;
    it = pending_.emplace(desc.name, std::move(p)).first;
  }
  Pending& p = it->second;
  if (p.submitted[rank]) {  // a member refuses a second tensor of a name in flight, so: a bug
    Error(p.name, Code::kInvalidArgument, Str("rank ", rank, " submitted tensor '", p.name, "' twice"));
    return Status::Ok();
  }
  p.submitted[rank] = true;
  p.desc[rank] = std::move(desc);
  p.weights[rank] = weights_[rank];
  ++p.count;
  return Status::Ok();
}

void Coordinator::Join(uint32_t rank) {
  if (joined_[rank]) return;
  joined_[rank] = true;
  ++joined_count_;
  Settle();  // collectives that waited only for this rank run now, before the join completes
  batch_.U8(static_cast<uint8_t>(ResponseType::kJoined));  // its hvd.join() may go on
  batch_.U32(rank);
  ++batch_count_;
  if (joined_count_ == opt_.size) {
    batch_.U8(static_cast<uint8_t>(ResponseType::kJoinDone));
    batch_.U32(rank);
    ++batch_count_;
    joined_.assign(opt_.size, false);
    joined_count_ = 0;
  }
}

void Coordinator::Leave(uint32_t rank) {
  gone_[rank] = true;
  members_[rank].Close();
}

bool Coordinator::Ready(const Pending& p) const {
  for (uint32_t r = 0; r < opt_.size; ++r) {
    if (!p.submitted[r] && !joined_[r]) return false;
  }
  return p.count > 0;
}

void Coordinator::Settle() {
  std::vector<Pending*> done;
  for (auto& [name, p] : pending_) {
    bool doomed = false;
    for (uint32_t r = 0; r < opt_.size; ++r) doomed |= gone_[r] && !p.submitted[r];
    if (doomed || Ready(p)) done.push_back(&p);
  }
  std::sort(done.begin(), done.end(), [](const Pending* a, const Pending* b) { return a->arrival < b->arrival; });
  std::vector<std::string> names;
  for (Pending* p : done) {
    Finish(*p);
    names.push_back(p->name);
  }
  for (const auto& name : names) pending_.erase(name);
}

void Coordinator::Finish(Pending& p) {
  std::vector<uint32_t> submitters, missing;
  for (uint32_t r = 0; r < opt_.size; ++r) (p.submitted[r] ? submitters : missing).push_back(r);
  for (uint32_t r : missing) {
    if (gone_[r]) {
      Error(p.name, Code::kAborted, Str("tensor '", p.name, "' was submitted by ranks ", RankList(submitters),
                                        " but rank ", r, " shut down before submitting it"));
      return;
    }
  }
  if (const char* kind = WithoutJoin(p.desc[submitters[0]].op); kind != nullptr && !missing.empty()) {
    // Horovod's messages (controller.cc): a joined rank has nothing to contribute to these
    Error(p.name, Code::kInvalidArgument,
          Str(kind, " is not supported with Join at this time: tensor '", p.name, "' was submitted by ranks ",
              RankList(submitters), " while ranks ", RankList(missing), " had joined"));
    return;
  }
  const uint32_t lead = submitters[0];
  bool same = true;
  for (uint32_t r : submitters) same &= p.desc[r] == p.desc[lead];
  if (!same) {
    Error(p.name, Code::kMismatch,
          Str("collective mismatch for tensor '", p.name, "': the ranks disagree on its ",
              Disagreement(submitters, p.desc), ". A tensor name must describe the same collective on every rank."));
    return;
  }
  const std::vector<double>& weights = *p.weights[lead];
  for (uint32_t r : submitters) {
    if (p.weights[r]->size() != weights.size()) {  // every rank runs as many lanes (config hash)
      Error(p.name, Code::kMismatch, Str("collective mismatch for tensor '", p.name, "': rank ", r, " has ",
                                         p.weights[r]->size(), " lanes, rank ", lead, " ", weights.size()));
      return;
    }
  }
  // The lead's weights cut the run order; an allgather's or a reduce-scatter's row is laid out by
  // equal shares of its width on every rank (gather.py, scatter.py), so its lanes carry size x
  // those boundaries.
  std::vector<uint64_t> bounds;
  const WireDesc& desc = p.desc[lead];
  if (RowsPerRank(desc.op)) {
    bounds = ShardBoundaries(desc.count / opt_.size, std::vector<double>(weights.size(), 1.0));
    for (uint64_t& b : bounds) b *= opt_.size;
  } else {
    bounds = ShardBoundaries(desc.count, weights);
  }
  uint32_t id;
  bool describe = false;
  auto known = id_of_.find(p.name);
  if (known == id_of_.end()) {
    id = static_cast<uint32_t>(by_id_.size());
    id_of_[p.name] = id;
    by_id_.push_back(p.desc[lead]);
    describe = true;
  } else {
    id = known->second;
    describe = !(by_id_[id] == p.desc[lead]);
    by_id_[id] = p.desc[lead];
  }
  batch_.U8(static_cast<uint8_t>(ResponseType::kRun));
  batch_.U32(id);
  batch_.U8(describe ? 1 : 0);
  if (describe) batch_.Desc(p.desc[lead]);
  batch_.U64s(bounds);
  ++batch_count_;
}

void Coordinator::Error(const std::string& name, Code code, const std::string& message) {
  batch_.U8(static_cast<uint8_t>(ResponseType::kError));
  batch_.Text(name);
  batch_.U32(static_cast<uint32_t>(code));
  batch_.Text(message);
  ++batch_count_;
}

void Coordinator::CheckStalls() {
  const int64_t now = NowNs();
  if (now - last_stall_check_ns_ < 200'000'000) return;
  last_stall_check_ns_ = now;
  std::vector<std::string> doomed;
  for (auto& [name, p] : pending_) {
    const double age = (now - p.first_ns) / 1e9;
    std::vector<uint32_t> submitters, missing;
    for (uint32_t r = 0; r < opt_.size; ++r) (p.submitted[r] || joined_[r] ? submitters : missing).push_back(r);
    if (opt_.stall_shutdown_seconds > 0 && age > opt_.stall_shutdown_seconds) {
      Error(name, Code::kTimeout,
            Str("tensor '", name, "' was submitted by ranks ", RankList(submitters), " but not by ranks ",
                RankList(missing), " within ", opt_.stall_shutdown_seconds,
                " s (FASTHOROVOD_STALL_SHUTDOWN_SECONDS); one or more ranks may have stopped or taken "
                "another code path"));
      doomed.push_back(name);
    } else if (opt_.stall_check_seconds > 0 && age > opt_.stall_check_seconds && !p.warned) {
      p.warned = true;
      std::fprintf(stderr,
                   "[fasthorovod] stall: tensor '%s' was submitted by ranks %s %.0f s ago and is still "
                   "waiting for ranks %s. One or more ranks may have stopped, or submitted different "
                   "tensors; if the missing ranks sent it through Horovod instead, its size or dtype "
                   "differs between ranks (FASTHOROVOD_STALL_CHECK_SECONDS)\n",
                   name.c_str(), RankList(submitters).c_str(), age, RankList(missing).c_str());
    }
  }
  for (const auto& name : doomed) pending_.erase(name);
}

Status Coordinator::Flush() {
  if (batch_count_ == 0) return Status::Ok();
  WireWriter w;
  w.U32(batch_count_);
  w.Bytes(batch_.body());
  batch_.Clear();
  batch_count_ = 0;
  const std::string frame = w.Frame(MsgType::kResponses);
  for (uint32_t r = 0; r < opt_.size; ++r) {
    if (!members_[r].valid()) continue;
    Status st = SendFrame(members_[r].fd(), frame, Deadline::After(opt_.timeout_seconds), Str("rank ", r));
    if (!st.ok() && !gone_[r]) {
      return Status::Error(Code::kPeerError, Str("cannot reach rank ", r, " from the coordinator: ", st.message()));
    }
  }
  return Status::Ok();
}

void Coordinator::Broadcast(MsgType type, const std::string& payload) {
  WireWriter w;
  w.Bytes(payload);
  const std::string frame = w.Frame(type);
  for (uint32_t r = 0; r < opt_.size; ++r) {
    if (members_[r].valid()) SendFrame(members_[r].fd(), frame, Deadline::After(2.0), Str("rank ", r));
  }
}

}  // namespace fasthorovod
