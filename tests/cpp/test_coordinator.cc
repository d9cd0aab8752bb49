// The negotiation's coordinator, driven by hand-written members speaking its wire protocol:
// ready order, the response cache, the lead rank's lane weights, mismatches, join, the stall
// shutdown and a dead rank; and real members: the names they keep in flight, their tickets.
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/collective.h"
#include "harness.h"
#include "negotiation/coordinator.h"
#include "negotiation/member.h"
#include "negotiation/wire.h"
#include "proxy/client.h"
#include "shm/channel.h"
#include "shm/handoff.h"

using namespace fasthorovod;

namespace {

const std::string kToken(kTokenBytes, '\x07');

struct Run {
  uint32_t id = 0;
  bool described = false;
  WireDesc desc;
  std::vector<uint64_t> bounds;
};

struct Reply {
  std::vector<Run> runs;
  std::vector<std::pair<std::string, Code>> errors;
  int64_t join_done = -1;
  std::vector<uint32_t> joined;  // ranks whose join the coordinator acknowledged (kJoined)
  bool failed = false;
  std::string failure;
};

class FakeMember {
 public:
  FakeMember(int port, uint32_t rank, uint32_t size, const std::string& token = kToken,
             const std::vector<double>& weights = {1.0, 1.0}) {
    CHECK(ConnectWithRetry("127.0.0.1", port, Deadline::After(5), &sock_).ok());
    LinkIdentity self;
    std::memcpy(self.token, token.data(), kTokenBytes);
    self.rank = rank;
    self.size = size;
    handshake = AuthenticateToPeer(sock_.fd(), self, LinkPurpose::kNegotiation, 0, 0, Deadline::After(5),
                                   "coordinator");
    if (handshake.ok()) Weights(weights);  // as a member's start-up does (equal weights, one per lane)
  }
  Status handshake;
  // This rank's lane weights from its next announcement on.
  void Weights(const std::vector<double>& weights) {
    WireWriter w;
    w.F64s(weights);
    CHECK(SendFrame(sock_.fd(), w.Frame(MsgType::kWeights), Deadline::After(5), "coordinator").ok());
  }
  // Announces (full description, or the cached id when id >= 0).
  void Announce(const std::vector<std::pair<WireDesc, int64_t>>& entries) {
    WireWriter w;
    w.U32(static_cast<uint32_t>(entries.size()));
    for (const auto& [desc, id] : entries) {
      w.U8(id >= 0 ? 1 : 0);
      if (id >= 0) {
        w.U32(static_cast<uint32_t>(id));
      } else {
        w.Desc(desc);
      }
    }
    CHECK(SendFrame(sock_.fd(), w.Frame(MsgType::kAnnounce), Deadline::After(5), "coordinator").ok());
  }
  void Send(MsgType type) {
    CHECK(SendFrame(sock_.fd(), WireWriter().Frame(type), Deadline::After(5), "coordinator").ok());
  }
  // The next batch that holds more than acknowledgements of joins (kJoined, collected in
  // Reply::joined across the batches read).
  Reply Receive(double seconds = 5) {
    Reply reply;
    while (ReceiveOne(seconds, &reply)) {
    }
    return reply;
  }
  // Reads one batch into `reply`; true when it held only kJoined entries.
  bool ReceiveOne(double seconds, Reply* out) {
    Reply& reply = *out;
    MsgType type;
    std::string payload;
    Status st;
    do {  // the welcome (every rank is in) comes before anything else
      st = RecvFrame(sock_.fd(), Deadline::After(seconds), "coordinator", &type, &payload);
    } while (st.ok() && type == MsgType::kWelcome);
    CHECK(st.ok());
    if (!st.ok()) return false;
    WireReader in(payload);
    if (type == MsgType::kFailed) {
      in.U32();
      reply.failed = true;
      reply.failure = in.Text();
      return false;
    }
    CHECK(type == MsgType::kResponses);
    const uint32_t n = in.U32();
    bool only_joined = true;
    for (uint32_t i = 0; i < n; ++i) {
      const auto kind = static_cast<ResponseType>(in.U8());
      only_joined = only_joined && kind == ResponseType::kJoined;
      switch (kind) {
        case ResponseType::kRun: {
          Run run;
          run.id = in.U32();
          run.described = in.U8() != 0;
          if (run.described) run.desc = in.Desc();
          run.bounds = in.U64s();
          reply.runs.push_back(run);
          break;
        }
        case ResponseType::kError: {
          std::string name = in.Text();
          Code code = static_cast<Code>(in.U32());
          in.Text();
          reply.errors.emplace_back(name, code);
          break;
        }
        case ResponseType::kJoinDone:
          reply.join_done = in.U32();
          break;
        case ResponseType::kJoined:
          reply.joined.push_back(in.U32());
          break;
      }
    }
    CHECK(in.ok() && in.done());
    return only_joined && n > 0;
  }
  void Close() { sock_.Close(); }

 private:
  Socket sock_;
};

WireDesc Desc(const std::string& name, uint64_t count, uint64_t shape_hash = 1) {
  WireDesc d;
  d.name = name;
  d.shape = std::to_string(count);
  d.dtype = 7;
  d.op = 0;
  d.count = count;
  d.name_hash = std::hash<std::string>()(name);
  d.shape_hash = shape_hash;
  return d;
}

std::unique_ptr<Coordinator> Start(uint32_t size, int* port, double stall_shutdown = 0, double timeout = 5) {
  CoordinatorOptions o;
  o.size = size;
  o.token = kToken;
  o.bind_host = "127.0.0.1";
  o.timeout_seconds = timeout;
  o.stall_check_seconds = 0;
  o.stall_shutdown_seconds = stall_shutdown;
  std::unique_ptr<Coordinator> c;
  CHECK(Coordinator::Start(o, &c, port).ok());
  return c;
}

}  // namespace

TEST(CoordinatorRunsWhatEveryRankSubmittedInTheOrderItBecameReady) {
  int port = 0;
  auto coordinator = Start(2, &port);
  FakeMember a(port, 0, 2), b(port, 1, 2);
  a.Announce({{Desc("x", 8), -1}, {Desc("y", 6), -1}});
  b.Announce({{Desc("y", 6), -1}});  // y is ready first, although rank 0 submitted x first
  Reply first = a.Receive();
  CHECK_EQ(b.Receive().runs.size(), 1u);
  CHECK_EQ(first.runs.size(), 1u);
  CHECK(first.runs[0].described && first.runs[0].desc.name == "y");
  CHECK(first.runs[0].bounds == std::vector<uint64_t>({0, 3, 6}));
  b.Announce({{Desc("x", 8), -1}});
  Reply second = a.Receive();
  b.Receive();
  CHECK(second.runs.size() == 1 && second.runs[0].desc.name == "x");
  // The response cache: x again, announced by its id on rank 0; the run order carries the id only.
  const uint32_t x = second.runs[0].id;
  a.Announce({{Desc("x", 8), x}});
  b.Announce({{Desc("x", 8), -1}});
  Reply third = a.Receive();
  b.Receive();
  CHECK(third.runs.size() == 1 && third.runs[0].id == x && !third.runs[0].described);
}

TEST(CoordinatorCutsEachRunOrderByTheWeightsItsLeadRankHadWhenItAnnounced) {
  int port = 0;
  auto coordinator = Start(3, &port);
  FakeMember a(port, 0, 3), b(port, 1, 3), c(port, 2, 3);
  a.Weights({1.0, 3.0});
  b.Weights({3.0, 1.0});  // the ranks need not agree
  auto runs = [&](size_t n) {
    std::vector<std::vector<Run>> got;
    for (FakeMember* m : {&a, &b, &c}) {
      std::vector<Run> mine;
      while (mine.size() < n) {
        Reply r = m->Receive();
        if (r.runs.empty()) break;
        mine.insert(mine.end(), r.runs.begin(), r.runs.end());
      }
      CHECK_EQ(mine.size(), n);
      got.push_back(mine);
    }
    CHECK(got[1].size() == n && got[2].size() == n);
    for (size_t i = 0; i < n && got[1].size() == n && got[2].size() == n; ++i) {
      CHECK(got[1][i].bounds == got[0][i].bounds && got[2][i].bounds == got[0][i].bounds);
    }
    return got[0];
  };
  c.Announce({{Desc("x", 8), -1}});
  b.Announce({{Desc("x", 8), -1}});
  a.Announce({{Desc("x", 8), -1}});  // the lead (rank 0) comes last: its weights still decide
  std::vector<Run> x = runs(1);
  CHECK(x.size() == 1 && x[0].bounds == std::vector<uint64_t>({0, 2, 8}));
  // The weights rank 0 had when it announced y, not those it sent after.
  a.Announce({{Desc("y", 8), -1}});
  a.Weights({1.0, 1.0});
  a.Announce({{Desc("z", 8), -1}});
  b.Announce({{Desc("y", 8), -1}, {Desc("z", 8), -1}});
  c.Announce({{Desc("y", 8), -1}, {Desc("z", 8), -1}});
  std::vector<Run> yz = runs(2);
  CHECK(yz.size() == 2 && yz[0].bounds == std::vector<uint64_t>({0, 2, 8}));
  CHECK(yz.size() == 2 && yz[1].bounds == std::vector<uint64_t>({0, 4, 8}));
  // An allgather's rows (3 of 5 elements) are laid out by equal shares whatever the weights.
  WireDesc gather = Desc("g", 15);
  gather.op = static_cast<uint32_t>(ReduceOp::kGather);
  a.Weights({1.0, 3.0});
  for (FakeMember* m : {&a, &b, &c}) m->Announce({{gather, -1}});
  std::vector<Run> g = runs(1);
  CHECK(g.size() == 1 && g[0].bounds == std::vector<uint64_t>({0, 6, 15}));
  // Rank 0 has joined: the lowest rank that submitted leads.
  a.Send(MsgType::kJoin);
  b.Announce({{Desc("w", 8), -1}});
  c.Announce({{Desc("w", 8), -1}});
  std::vector<Run> w = runs(1);
  CHECK(w.size() == 1 && w[0].bounds == std::vector<uint64_t>({0, 6, 8}));
}

TEST(CoordinatorRefusesCollectivesThatAJoinedRankCannotTakePartIn) {
  int port = 0;
  auto coordinator = Start(2, &port);
  FakeMember a(port, 0, 2), b(port, 1, 2);
  a.Send(MsgType::kJoin);
  for (auto [op, kind] : {std::pair{ReduceOp::kGather, "Allgather"}, std::pair{ReduceOp::kReduceScatter, "Reducescatter"},
                          std::pair{ReduceOp::kBroadcast, "Broadcast"}}) {
    WireDesc desc = Desc(kind, 8);
    desc.op = static_cast<uint32_t>(op);
    b.Announce({{desc, -1}});
    Reply r = b.Receive();
    while (r.errors.empty() && r.runs.empty()) r = b.Receive();  // past the join's acknowledgement
    // Horovod's message ("Allgather is not supported with Join ...") is checked end to end
    // (tests/workers/worker.py, scenario_allgather)
    CHECK(r.runs.empty() && r.errors.size() == 1 && r.errors[0].first == kind &&
          r.errors[0].second == Code::kInvalidArgument);
  }
}

TEST(CoordinatorFailsATensorWhoseRanksRunDifferentNumbersOfLanes) {
  int port = 0;
  auto coordinator = Start(2, &port);
  FakeMember a(port, 0, 2), b(port, 1, 2, kToken, {1.0, 1.0, 1.0});
  a.Announce({{Desc("l", 8), -1}});
  b.Announce({{Desc("l", 8), -1}});
  for (FakeMember* m : {&a, &b}) {
    Reply r = m->Receive();
    CHECK(r.runs.empty() && r.errors.size() == 1);
    CHECK(r.errors[0].first == "l" && r.errors[0].second == Code::kMismatch);
  }
}

TEST(CoordinatorFailsAMismatchOnEveryRankAndGoesOn) {
  int port = 0;
  auto coordinator = Start(2, &port);
  FakeMember a(port, 0, 2), b(port, 1, 2);
  a.Announce({{Desc("w", 8, 1), -1}});
  b.Announce({{Desc("w", 8, 2), -1}});  // same name, another shape
  for (FakeMember* m : {&a, &b}) {
    Reply r = m->Receive();
    CHECK(r.runs.empty() && r.errors.size() == 1);
    CHECK(r.errors[0].first == "w" && r.errors[0].second == Code::kMismatch);
  }
  a.Announce({{Desc("v", 4), -1}});
  b.Announce({{Desc("v", 4), -1}});
  CHECK_EQ(a.Receive().runs.size(), 1u);
  CHECK_EQ(b.Receive().runs.size(), 1u);
}

TEST(CoordinatorCountsJoinedRanksAsReadyAndNamesTheLastJoiner) {
  int port = 0;
  auto coordinator = Start(3, &port);
  FakeMember a(port, 0, 3), b(port, 1, 3), c(port, 2, 3);
  b.Send(MsgType::kJoin);
  a.Announce({{Desc("z", 8), -1}});
  c.Announce({{Desc("z", 8), -1}});
  for (FakeMember* m : {&a, &b, &c}) CHECK_EQ(m->Receive().runs.size(), 1u);  // rank 1 fills zeros
  c.Send(MsgType::kJoin);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // so that rank 0 is surely the last
  a.Send(MsgType::kJoin);
  for (FakeMember* m : {&a, &b, &c}) {
    Reply r = m->Receive();
    CHECK_EQ(r.join_done, 0);
    CHECK(r.joined == std::vector<uint32_t>({2, 0}));  // every join acknowledged, in the order recorded
  }
}

TEST(CoordinatorRefusesABroadcastWhileARankHasJoined) {
  int port = 0;
  auto coordinator = Start(3, &port);
  FakeMember a(port, 0, 3), b(port, 1, 3), c(port, 2, 3);
  WireDesc broadcast = Desc("p", 8);
  broadcast.op = static_cast<uint32_t>(ReduceOp::kBroadcast);
  b.Send(MsgType::kJoin);  // a joined rank's zeros must never stand in for the root's tensor
  a.Announce({{broadcast, -1}});
  c.Announce({{broadcast, -1}});
  for (FakeMember* m : {&a, &b, &c}) {
    Reply r = m->Receive();
    CHECK(r.runs.empty() && r.errors.size() == 1);
    CHECK(r.errors[0].first == "p" && r.errors[0].second == Code::kInvalidArgument);
  }
  a.Announce({{Desc("q", 8), -1}});  // an allreduce still runs, rank 1 filling zeros
  c.Announce({{Desc("q", 8), -1}});
  for (FakeMember* m : {&a, &b, &c}) CHECK_EQ(m->Receive().runs.size(), 1u);
}

TEST(CoordinatorStallShutdownFailsTheTensor) {
  int port = 0;
  auto coordinator = Start(2, &port, 0.3);
  FakeMember a(port, 0, 2), b(port, 1, 2);
  a.Announce({{Desc("late", 8), -1}});
  Reply r = a.Receive(5);
  CHECK(r.errors.size() == 1 && r.errors[0].second == Code::kTimeout);
  b.Receive(5);
}

TEST(CoordinatorTellsEveryoneWhenARankDies) {
  int port = 0;
  auto coordinator = Start(2, &port);
  FakeMember a(port, 0, 2), b(port, 1, 2);
  a.Announce({{Desc("u", 8), -1}});
  b.Close();  // no goodbye: the rank died
  Reply r = a.Receive(5);
  CHECK(r.failed && r.failure.find("rank 1 disconnected") != std::string::npos);
}

TEST(CoordinatorAdmitsOnlyMembersThatProveTheToken) {
  int port = 0;
  auto coordinator = Start(2, &port);
  // Strangers first: silent, garbage, another job's token. None of them holds anyone up.
  Socket silent;
  CHECK(ConnectWithRetry("127.0.0.1", port, Deadline::After(5), &silent).ok());
  Socket garbage;
  CHECK(ConnectWithRetry("127.0.0.1", port, Deadline::After(5), &garbage).ok());
  const std::string junk(100, 'x');
  CHECK(SendAll(garbage.fd(), junk.data(), junk.size(), Deadline::After(1), "coordinator").ok());
  FakeMember impostor(port, 1, 2, std::string(kTokenBytes, '\x09'));
  CHECK(!impostor.handshake.ok());
  CHECK(impostor.handshake.message().find("did not accept this connection's proof") != std::string::npos);
  FakeMember a(port, 0, 2), b(port, 1, 2);
  CHECK(a.handshake.ok() && b.handshake.ok());
  a.Announce({{Desc("z", 4), -1}});
  b.Announce({{Desc("z", 4), -1}});
  CHECK_EQ(a.Receive().runs.size(), 1u);
  CHECK_EQ(b.Receive().runs.size(), 1u);
}

TEST(CoordinatorWaitsForTheOthersFromTheFirstMembersArrival) {
  // Ranks reach their members after their rings are up, later than the coordinator started on a
  // loaded host: the timeout counts from the first member, not from the start.
  int port = 0;
  auto coordinator = Start(2, &port, 0, /*timeout=*/1.0);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  FakeMember a(port, 0, 2);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  FakeMember b(port, 1, 2);
  CHECK(a.handshake.ok() && b.handshake.ok());
  a.Announce({{Desc("late", 4), -1}});
  b.Announce({{Desc("late", 4), -1}});
  CHECK_EQ(a.Receive().runs.size(), 1u);
}

TEST(CoordinatorThatGaveUpRefusesLateMembersAtOnceAndSaysWhoWasMissing) {
  int port = 0;
  auto coordinator = Start(3, &port, 0, /*timeout=*/0.5);
  FakeMember a(port, 0, 3);
  CHECK(a.handshake.ok());
  Reply r = a.Receive(5);
  CHECK(r.failed && r.failure.find("missing: [1, 2]") != std::string::npos);
  // The listener is closed: a late rank is refused, not left in the listen queue until Stop().
  Socket late;
  Status st = ConnectWithRetry("127.0.0.1", port, Deadline::After(0.3), &late);
  CHECK(!st.ok());
}

namespace {

// A real member of rank `rank` of 2 (two lanes, no proxies) started against the coordinator at `port`.
Status StartMember(int port, uint32_t rank, std::unique_ptr<ProxyChannel>* channel, std::unique_ptr<Member>* member) {
  ChannelConfig config;
  config.num_lanes = 2;
  config.rank = rank;
  config.size = 2;
  config.token = kToken;
  config.bind_host = "127.0.0.1";
  CHECK(ProxyChannel::Create(config, channel).ok());
  MemberOptions o;
  o.rank = rank;
  o.size = 2;
  o.token = kToken;
  o.coordinator_host = "127.0.0.1";
  o.coordinator_port = port;
  o.timeout_seconds = 1.0;
  return Member::Start(channel->get(), o, member);
}

}  // namespace

TEST(MemberStartReturnsOnlyOnceEveryRankIsConnected) {
  // Start-up is a barrier: a rank that went on before the others were in could shut its data
  // plane down (restart, shutdown) while they are still joining it.
  int port = 0;
  auto coordinator = Start(2, &port, 0, /*timeout=*/1.0);
  std::unique_ptr<ProxyChannel> channel0, channel1;
  std::unique_ptr<Member> member0, member1;
  int64_t returned_ns = 0;
  std::thread first([&] {
    CHECK(StartMember(port, 0, &channel0, &member0).ok());
    returned_ns = NowNs();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  const int64_t second_ns = NowNs();
  CHECK(StartMember(port, 1, &channel1, &member1).ok());
  first.join();
  CHECK(returned_ns >= second_ns);
  member0->Close();
  member1->Close();
}

TEST(MemberStartFailsWithTheCoordinatorsReasonWhenARankNeverComes) {
  int port = 0;
  auto coordinator = Start(2, &port, 0, /*timeout=*/0.5);
  std::unique_ptr<ProxyChannel> channel;
  std::unique_ptr<Member> member;
  Status st = StartMember(port, 0, &channel, &member);
  std::printf("    %s\n", st.message().c_str());
  CHECK(!st.ok() && st.message().find("missing: [1]") != std::string::npos);
}

namespace {

// Stands in for a channel's proxies: maps the channel (handed to lane 0's socket) and completes
// every request at once, moving no data; records each request's lane boundaries by its name.
class FakeLanes {
 public:
  explicit FakeLanes(ProxyChannel* channel) : sock_(channel->ProxyFd(0)) {
    thread_ = std::thread([this] { Run(); });
  }
  ~FakeLanes() {
    stop_.store(true);
    thread_.join();
    if (header_ != nullptr) munmap(header_, sizeof(ChannelHeader));
  }
  std::vector<uint64_t> Bounds(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    return bounds_[name];
  }

 private:
  void Run() {
    uint64_t next = 0;
    while (!stop_.load()) {
      SegmentGrant grant;  // the channel first, then data buffers (dropped: nothing is read)
      if (ReceiveSegment(sock_, header_ == nullptr ? 50 : 0, &grant).ok() && grant.fd >= 0) {
        if (grant.id == kChannelSegment && header_ == nullptr) {
          void* p = mmap(nullptr, sizeof(ChannelHeader), PROT_READ | PROT_WRITE, MAP_SHARED, grant.fd, 0);
          if (p != MAP_FAILED) header_ = static_cast<ChannelHeader*>(p);
        }
        close(grant.fd);
      }
      if (header_ == nullptr) continue;
      for (const uint32_t head = header_->head.load(std::memory_order_acquire); next < head; ++next) {
        RequestSlot& slot = header_->slots[next % kNumSlots];
        {
          std::lock_guard<std::mutex> lock(mu_);
          bounds_[slot.desc.name].assign(slot.desc.lane_begin, slot.desc.lane_begin + slot.desc.num_lanes + 1);
        }
        slot.lanes_done.store(header_->num_lanes, std::memory_order_release);
        FutexWakeAll(&slot.lanes_done);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  int sock_;
  ChannelHeader* header_ = nullptr;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::mutex mu_;
  std::map<std::string, std::vector<uint64_t>> bounds_;
};

// Two real members (two lanes each) of a real coordinator, their proxies faked.
struct TwoMembers {
  std::unique_ptr<Coordinator> coordinator;
  std::unique_ptr<ProxyChannel> channel[2];
  std::unique_ptr<Member> member[2];
  std::unique_ptr<FakeLanes> lanes[2];

  TwoMembers() {
    int port = 0;
    coordinator = Start(2, &port);
    std::thread second([&] { CHECK(StartMember(port, 1, &channel[1], &member[1]).ok()); });
    CHECK(StartMember(port, 0, &channel[0], &member[0]).ok());
    second.join();
    for (int r = 0; r < 2; ++r) lanes[r] = std::make_unique<FakeLanes>(channel[r].get());
  }
  ~TwoMembers() {
    for (auto& m : member) m->Close();
  }
};

Status Submit(Member& member, const std::string& name, uint64_t count, uint64_t* ticket,
              ReduceOp op = ReduceOp::kSum) {
  RequestDesc request;
  request.dtype = static_cast<uint32_t>(DType::kFloat32);
  request.op = static_cast<uint32_t>(op);
  request.count = count;
  request.shape_hash = count;
  CopyString(request.name, name);
  return member.Submit(request, std::to_string(count), ticket);
}

bool PollFor(Member& member, uint64_t ticket, double seconds = 5) {
  Deadline deadline = Deadline::After(seconds);
  while (!member.Poll(ticket)) {
    if (deadline.Expired()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

std::string Duplicate(const char* verb, const std::string& name) {
  return Str("Requested to ", verb, " a tensor with the same name as another tensor that is currently being "
             "processed: '", name, "'");
}

}  // namespace

TEST(AFailureAnywhereBreaksEveryRanksChannelWithItsCause) {
  // rank 1's data plane breaks: the coordinator tells rank 0, whose member breaks rank 0's channel
  // too (its lanes abort with the cause, also one still connecting a mesh to the failed rank)
  TwoMembers job;
  CHECK(job.channel[0]->Health().ok());
  job.channel[1]->Break(Status::Error(Code::kProxyDied, "rank 1 lane 0: its proxy died"));
  const int64_t until = NowNs() + 5'000'000'000;
  while (job.channel[0]->Health().ok() && NowNs() < until) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const Status st = job.channel[0]->Health();
  CHECK(!st.ok());
  CHECK(st.message().find("rank 1 lane 0: its proxy died") != std::string::npos);
  CHECK(!job.member[0]->Broken().ok());
}

TEST(AProxyThatLeavesAfterItsWorkerStoppedItBreaksNothing) {
  // rank 1 shuts down: its proxies exit (status 0) once told to stop, while rank 1's member still
  // checks the channel's health every 100 ms; that exit must not reach rank 0 as a failure (it
  // would fail rank 0's last collectives, still receiving what rank 1 sent before it left)
  TwoMembers job;
  const int child = fork();
  if (child == 0) {
    usleep(100'000);
    _exit(0);
  }
  CHECK(child > 0);
  CHECK(job.channel[1]->WatchProxy(0, child).ok());
  job.channel[1]->Stop();
  const int64_t until = NowNs() + 600'000'000;  // the member's health checks see the exit
  while (NowNs() < until) {
    CHECK(job.channel[0]->Health().ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(job.channel[1]->Health().ok());
  CHECK(job.member[0]->Broken().ok());
}

TEST(MemberKeepsANameInFlightUntilItsTicketIsWaitedOnOrFails) {
  TwoMembers job;
  Member& m0 = *job.member[0];
  Member& m1 = *job.member[1];
  constexpr uint64_t kBase = uint64_t{1} << 48;
  CHECK(m0.NumberTicketsFrom(kBase).ok());
  uint64_t a0 = 0, a1 = 0, again = 0;
  CHECK(Submit(m0, "a", 8, &a0).ok());
  CHECK_EQ(a0, kBase);                         // the facade's handle is the ticket
  CHECK(!m0.NumberTicketsFrom(7).ok());        // fixed once a ticket is filed
  Status dup = Submit(m0, "a", 8, &again);     // Horovod's error, word for word
  CHECK(dup.code() == Code::kInvalidArgument && dup.message() == Duplicate("allreduce", "a"));
  CHECK(Submit(m1, "a", 8, &a1).ok());
  CHECK(PollFor(m0, a0));                      // run and done, not yet waited on: still in flight
  CHECK(Submit(m0, "a", 8, &again).code() == Code::kInvalidArgument);
  CHECK(m0.Wait(a0, 5, nullptr).ok() && m1.Wait(a1, 5, nullptr).ok());
  CHECK(m0.Wait(a0, 5, nullptr).code() == Code::kInvalidArgument);  // consumed
  CHECK(!m0.Holds("a") && !m1.Holds("a"));
  CHECK(Submit(m0, "a", 8, &a0).ok() && Submit(m1, "a", 8, &a1).ok());  // free at once after the wait
  CHECK(m0.Holds("a") && !m0.Holds("b"));
  // a name longer than a request holds is cut the same way for both
  const std::string long_name = "L" + std::string(2 * kNameBytes, 'y');
  uint64_t l0 = 0, l1 = 0;
  CHECK(Submit(m0, long_name, 8, &l0).ok() && m0.Holds(long_name) && m0.Holds(long_name.substr(0, kNameBytes - 1)));
  CHECK(Submit(m1, long_name, 8, &l1).ok() && m0.Wait(l0, 5, nullptr).ok() && m1.Wait(l1, 5, nullptr).ok());
  CHECK(!m0.Holds(long_name));
  CHECK_EQ(a0, kBase + 1);
  CHECK(m0.Wait(a0, 5, nullptr).ok() && m1.Wait(a1, 5, nullptr).ok());

  // Horovod's verb for each kind of collective.
  uint64_t b0 = 0, b1 = 0, g0 = 0, g1 = 0;
  CHECK(Submit(m0, "b", 8, &b0, ReduceOp::kBroadcast).ok());
  dup = Submit(m0, "b", 8, &again, ReduceOp::kBroadcast);
  CHECK(dup.code() == Code::kInvalidArgument && dup.message() == Duplicate("broadcast", "b"));
  CHECK(Submit(m0, "g", 8, &g0, ReduceOp::kGather).ok());
  dup = Submit(m0, "g", 8, &again, ReduceOp::kGather);
  CHECK(dup.code() == Code::kInvalidArgument && dup.message() == Duplicate("allgather", "g"));
  CHECK(Submit(m1, "b", 8, &b1, ReduceOp::kBroadcast).ok() && Submit(m1, "g", 8, &g1, ReduceOp::kGather).ok());
  for (auto [m, t] : {std::pair{&m0, b0}, {&m0, g0}, {&m1, b1}, {&m1, g1}}) CHECK(m->Wait(t, 5, nullptr).ok());

  // A collective that fails frees its name when it fails; waiting on it afterwards frees nothing
  // that a later collective of the name holds.
  uint64_t f0 = 0, f1 = 0;
  CHECK(Submit(m0, "m", 8, &f0).ok() && Submit(m1, "m", 9, &f1).ok());  // a mismatch
  CHECK(PollFor(m0, f0) && PollFor(m1, f1));
  uint64_t n0 = 0, n1 = 0;
  CHECK(Submit(m0, "m", 8, &n0).ok());
  CHECK(m0.Wait(f0, 5, nullptr).code() == Code::kMismatch);
  CHECK(m1.Wait(f1, 5, nullptr).code() == Code::kMismatch);
  CHECK(Submit(m0, "m", 8, &again).code() == Code::kInvalidArgument && m0.Holds("m"));  // n0 holds it
  CHECK(Submit(m1, "m", 8, &n1).ok());
  CHECK(m0.Wait(n0, 5, nullptr).ok() && m1.Wait(n1, 5, nullptr).ok());
}

TEST(MembersCutTheirShardsWhereTheLeadRanksWeightsSay) {
  TwoMembers job;
  Member& m0 = *job.member[0];
  Member& m1 = *job.member[1];
  CHECK(m0.SetLaneWeights({1.0, 3.0}).ok());
  CHECK(m1.SetLaneWeights({3.0, 1.0}).ok());
  auto run = [&](const std::string& name, uint64_t count, ReduceOp op = ReduceOp::kSum) {
    uint64_t t0 = 0, t1 = 0;
    CHECK(Submit(m0, name, count, &t0, op).ok() && Submit(m1, name, count, &t1, op).ok());
    CHECK(m0.Wait(t0, 5, nullptr).ok() && m1.Wait(t1, 5, nullptr).ok());
    CHECK(job.lanes[0]->Bounds(name) == job.lanes[1]->Bounds(name));
    return job.lanes[0]->Bounds(name);
  };
  CHECK(run("x", 8) == std::vector<uint64_t>({0, 2, 8}));  // rank 0's
  CHECK(m0.SetLaneWeights({1.0, 1.0}).ok());                // applies to the very next submission
  CHECK(run("y", 8) == std::vector<uint64_t>({0, 4, 8}));
  CHECK(m0.SetLaneWeights({1.0, 3.0}).ok());
  CHECK(run("g", 10, ReduceOp::kGather) == std::vector<uint64_t>({0, 4, 10}));  // 2 rows x equal halves of 5
  CHECK(run("s", 10, ReduceOp::kReduceScatter) == std::vector<uint64_t>({0, 4, 10}));  // laid out as a gather
  for (const std::vector<double>& bad : std::vector<std::vector<double>>{
           {1.0}, {1.0, 0.0}, {1.0, -2.0}, {1.0, std::nan("")}, {1.0, INFINITY}, {}}) {
    Status st = m0.SetLaneWeights(bad);
    std::printf("    %s\n", st.message().c_str());
    CHECK(st.code() == Code::kInvalidArgument);
  }
}

TEST(ShardBoundariesCutInProportionToTheWeights) {
  CHECK(ShardBoundaries(8, {1.0, 3.0}) == std::vector<uint64_t>({0, 2, 8}));
  CHECK(ShardBoundaries(10, {1.0, 1.0, 1.0}) == std::vector<uint64_t>({0, 3, 6, 10}));
  CHECK(ShardBoundaries(0, {1.0, 2.0}) == std::vector<uint64_t>({0, 0, 0}));
  CHECK(ShardBoundaries(5, {2.0}) == std::vector<uint64_t>({0, 5}));
  CHECK(ShardBoundaries(3, {1e-300, 1e300}) == std::vector<uint64_t>({0, 0, 3}));
  CHECK(LaneWeightsProblem({1.0, 2.0}, 2).empty());
  CHECK(!LaneWeightsProblem({1.0, 2.0}, 3).empty() && !LaneWeightsProblem({1e308, 1e308}, 0).empty());
}
