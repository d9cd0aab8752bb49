// Hostile peers that hold the job token: a ring neighbour, a negotiation member and a
// coordinator that, once authenticated, send frames with oversized lengths, wrong descriptors,
// out-of-range fields, truncated frames and random bytes. Every such frame must fail the victim
// with a protocol error that names the peer and the field, within its timeout, without a crash and
// without allocating what the frame claims (checked against the process's resident memory).
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "collectives/ring.h"
#include "common/clock.h"
#include "loopback.h"
#include "negotiation/coordinator.h"
#include "negotiation/member.h"
#include "negotiation/wire.h"
#include "proxy/client.h"

using namespace fasthorovod;
using fhtest::ConnectRing;

namespace {

// The lane's frame header as it travels (transport/lane.cc; its size is asserted there too).
struct WireFrameHeader {
  uint32_t magic = 0x46485652u;
  uint16_t kind = 1;  // 1 data, 2 abort, 3 end
  uint16_t origin_code = 0;
  uint32_t origin_rank = 0;
  uint32_t step = 0;
  uint32_t segment = 0;
  uint32_t reserved = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  CollectiveDesc desc;
};
static_assert(sizeof(WireFrameHeader) == kFrameHeaderBytes, "the test's copy of the frame header is stale");

int64_t RssBytes() {
  long pages = 0, resident = 0;
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
  std::fclose(f);
  return static_cast<int64_t>(resident) * sysconf(_SC_PAGESIZE);
}

bool Contains(const Status& st, const std::string& what) { return st.message().find(what) != std::string::npos; }

std::string Report(const Status& st) { return Str("[", CodeName(st.code()), "] ", st.message()); }

constexpr size_t kCount = 1000;  // float32 elements of the victim's allreduce: chunk 0 = 500 elements

CollectiveDesc VictimDesc() {
  CollectiveDesc d;
  d.seq = 0;
  d.name_hash = 0x1234;
  d.total_bytes = d.shard_bytes = kCount * 4;
  d.dtype = static_cast<uint16_t>(DType::kFloat32);
  std::strncpy(d.name, "victim", kWireNameBytes - 1);
  return d;
}

WireFrameHeader Data(uint32_t step, uint32_t segment, uint64_t offset, uint64_t length) {
  WireFrameHeader h;
  h.desc = VictimDesc();
  h.step = step;
  h.segment = segment;
  h.offset = offset;
  h.length = length;
  return h;
}

std::string Bytes(const WireFrameHeader& h) { return std::string(reinterpret_cast<const char*>(&h), sizeof(h)); }

// Rank 1 of a two-rank ring runs a float32 allreduce of kCount elements; rank 0, which holds the
// token and completed the handshake, writes `hostile` to it instead of frames (then, with
// close_after, closes its sockets; otherwise stays silent). Returns rank 1's status; *seconds is how
// long it took, *rss_growth how much the process's resident memory grew meanwhile.
Status AgainstHostileNeighbour(const std::string& hostile, bool close_after, double timeout_seconds,
                               double* seconds = nullptr, int64_t* rss_growth = nullptr) {
  auto links = ConnectRing(2, 1);
  const int64_t rss_before = RssBytes();
  const int64_t start = NowNs();
  Status victim;
  std::thread t([&] {
    RingOptions o;
    static_cast<LaneOptions&>(o) = fhtest::Options(1, 2, timeout_seconds);
    std::vector<float> data(kCount, 1.0f);
    ShardWork work{data.data(), kCount, DType::kFloat32, 1.0, 1.0};
    RingStats stats;
    victim = RingAllreduce(links[1], VictimDesc(), work, o, &stats);
  });
  CHECK(SendAll(links[0].to_next[0].fd(), hostile.data(), hostile.size(), Deadline::After(5), "victim").ok());
  if (close_after) links[0].to_next[0].Close();
  t.join();
  if (seconds != nullptr) *seconds = (NowNs() - start) / 1e9;
  if (rss_growth != nullptr) *rss_growth = RssBytes() - rss_before;
  return victim;
}

}  // namespace

TEST(HostileNeighbourOversizedLengthFailsWithoutAllocating) {
  double seconds = 0;
  int64_t growth = 0;
  Status st = AgainstHostileNeighbour(Bytes(Data(0, 0, 0, uint64_t{1} << 60)) + std::string(4096, 'x'), false, 5,
                                      &seconds, &growth);
  std::printf("    %s (%.2f s, RSS %+lld KiB)\n", Report(st).c_str(), seconds, static_cast<long long>(growth >> 10));
  CHECK(!st.ok() && st.code() == Code::kIoError);
  CHECK(Contains(st, "protocol error from rank 0"));
  CHECK(Contains(st, "length 1152921504606846976"));
  CHECK(seconds < 2.0);
  CHECK(growth < (16 << 20));
}

TEST(HostileNeighbourWrongDescriptorIsAMismatch) {
  WireFrameHeader h = Data(0, 0, 0, 2000);
  h.desc.total_bytes = uint64_t{1} << 62;  // claims an enormous tensor
  Status st = AgainstHostileNeighbour(Bytes(h) + std::string(2000, '\0'), false, 5);
  std::printf("    %s\n", Report(st).c_str());
  CHECK(st.code() == Code::kMismatch);
  CHECK(Contains(st, "rank 0 runs tensor 'victim' (collective #0, 4611686018427387904 bytes"));
}

TEST(HostileNeighbourStepSegmentAndOffsetOutOfRange) {
  struct Case {
    WireFrameHeader h;
    const char* field;
  };
  const Case cases[] = {
      {Data(7, 0, 0, 2000), "frame with step 7 (the schedule has steps 0..1)"},
      {Data(0, 99, 0, 2000), "frame of step 0 with segment 99 (the step has 1)"},
      {Data(0, 0, 1 << 30, 2000), "with offset 1073741824 and length 2000 (the schedule says offset 0, length 2000)"},
  };
  for (const Case& c : cases) {
    Status st = AgainstHostileNeighbour(Bytes(c.h) + std::string(2000, '\0'), false, 5);
    std::printf("    %s\n", Report(st).c_str());
    CHECK(st.code() == Code::kIoError && Contains(st, "protocol error from rank 0"));
    CHECK(Contains(st, c.field));
  }
}

TEST(HostileNeighbourRepeatedFrameIsRefused) {
  const std::string frame = Bytes(Data(0, 0, 0, 2000)) + std::string(2000, '\0');
  Status st = AgainstHostileNeighbour(frame + frame, false, 5);
  std::printf("    %s\n", Report(st).c_str());
  CHECK(st.code() == Code::kIoError && Contains(st, "frame of step 0 segment 0 sent twice"));
}

TEST(HostileNeighbourEndMarkerWithAPayloadLength) {
  WireFrameHeader h = Data(0, 0, 0, 4096);
  h.kind = 3;
  Status st = AgainstHostileNeighbour(Bytes(h), false, 5);
  std::printf("    %s\n", Report(st).c_str());
  CHECK(Contains(st, "end marker of collective #0 with length field 4096 (must be 0)"));
}

TEST(HostileNeighbourEndMarkerCountingFramesThatNeverCame) {
  // One frame arrives, the end marker says two went on the socket: one was lost on the way.
  WireFrameHeader end = Data(0, 0, 2, 0);
  end.kind = 3;
  const std::string frame = Bytes(Data(0, 0, 0, 2000)) + std::string(2000, '\0');
  Status st = AgainstHostileNeighbour(frame + Bytes(end), false, 5);
  std::printf("    %s\n", Report(st).c_str());
  CHECK(st.code() == Code::kIoError && Contains(st, "collective #0 sent 2 frames on socket 0, 1 arrived"));
}

TEST(HostileNeighbourAbortFrames) {
  WireFrameHeader bad_origin = Data(0, 0, 0, 5);
  bad_origin.kind = 2;
  bad_origin.origin_rank = 1u << 31;
  Status st = AgainstHostileNeighbour(Bytes(bad_origin) + "hello", false, 5);
  std::printf("    %s\n", Report(st).c_str());
  CHECK(Contains(st, "corrupt abort frame from rank 0 (origin rank 2147483648 of 2 ranks)"));
  // A huge message length: at most kMaxAbortMessage bytes are read, for at most 2 s.
  WireFrameHeader huge = Data(0, 0, 0, uint64_t{1} << 62);
  huge.kind = 2;
  huge.origin_code = static_cast<uint16_t>(Code::kTimeout);
  double seconds = 0;
  int64_t growth = 0;
  st = AgainstHostileNeighbour(Bytes(huge) + "short reason", false, 5, &seconds, &growth);
  std::printf("    %s (%.2f s, RSS %+lld KiB)\n", Report(st).c_str(), seconds, static_cast<long long>(growth >> 10));
  CHECK(st.code() == Code::kTimeout && Contains(st, "[reported by rank 0]"));
  CHECK(seconds < 3.0 && growth < (16 << 20));
}

TEST(HostileNeighbourTruncatedFrames) {
  const std::string half = Bytes(Data(0, 0, 0, 2000)).substr(0, 50);
  Status closed = AgainstHostileNeighbour(half, true, 5);
  std::printf("    %s\n", Report(closed).c_str());
  CHECK(closed.code() == Code::kIoError && Contains(closed, "rank 0 closed the connection in the middle of collective #0"));
  double seconds = 0;
  Status silent = AgainstHostileNeighbour(Bytes(Data(0, 0, 0, 2000)) + std::string(100, '\0'), false, 1.0, &seconds);
  std::printf("    %s (%.2f s)\n", Report(silent).c_str(), seconds);
  CHECK(silent.code() == Code::kTimeout && Contains(silent, "waiting for data from rank 0"));
  CHECK(seconds > 0.9 && seconds < 2.5);
}

TEST(HostileNeighbourRandomBytes) {
  std::mt19937_64 rng(15);
  for (int trial = 0; trial < 20; ++trial) {
    std::string junk(64 + rng() % 4096, '\0');
    for (char& c : junk) c = static_cast<char>(rng());
    double seconds = 0;
    Status st = AgainstHostileNeighbour(junk, trial % 2 == 0, 1.0, &seconds);
    if (trial == 0) std::printf("    %s\n", Report(st).c_str());
    CHECK(!st.ok() && Contains(st, "rank 0"));
    CHECK(seconds < 2.5);
  }
}

// ------------------------------------------------------------------------------------------------
// The negotiation: a member that holds the token sends hostile frames to the coordinator.

namespace {

const std::string kToken(kTokenBytes, '\x07');

Socket JoinAs(int port, uint32_t rank, uint32_t size) {
  Socket sock;
  CHECK(ConnectWithRetry("127.0.0.1", port, Deadline::After(5), &sock).ok());
  LinkIdentity self;
  std::memcpy(self.token, kToken.data(), kTokenBytes);
  self.rank = rank;
  self.size = size;
  CHECK(AuthenticateToPeer(sock.fd(), self, LinkPurpose::kNegotiation, 0, 0, Deadline::After(5), "coordinator").ok());
  return sock;
}

// The next frame that is not the coordinator's welcome (sent once every rank is in).
Status RecvAfterWelcome(int fd, Deadline deadline, MsgType* type, std::string* payload) {
  do {
    FHVD_RETURN_IF_ERROR(RecvFrame(fd, deadline, "coordinator", type, payload));
  } while (*type == MsgType::kWelcome);
  return Status::Ok();
}

std::string RawFrame(uint32_t type, uint32_t length, const std::string& payload) {
  FrameHead head{kNegotiationMagic, type, length};
  return std::string(reinterpret_cast<const char*>(&head), sizeof(head)) + payload;
}

WireDesc Good(const std::string& name, uint64_t count) {
  WireDesc d;
  d.name = name;
  d.shape = std::to_string(count);
  d.dtype = static_cast<uint32_t>(DType::kFloat32);
  d.count = count;
  d.name_hash = 1;
  d.shape_hash = 2;
  return d;
}

std::string Weights(const std::vector<double>& weights) {
  WireWriter w;
  w.F64s(weights);
  return w.Frame(MsgType::kWeights);
}

// A kAnnounce of full descriptions, after the two equal lane weights a member's start-up sends
// (unless `weights` is false).
std::string Announcement(const std::vector<WireDesc>& entries, bool weights = true) {
  WireWriter w;
  w.U32(static_cast<uint32_t>(entries.size()));
  for (const auto& desc : entries) {
    w.U8(0);
    w.Desc(desc);
  }
  return (weights ? Weights({1.0, 1.0}) : "") + w.Frame(MsgType::kAnnounce);
}

// Rank 1 of two sends `hostile` after its handshake (then closes, or stays); rank 0 is honest and
// has announced a tensor. Returns what rank 0 is told (kFailed: its message), *seconds how long
// that took.
std::string CoordinatorFacesHostileMember(const std::string& hostile, bool close_after, double timeout_seconds = 5,
                                          double* seconds = nullptr, int64_t* rss_growth = nullptr) {
  CoordinatorOptions o;
  o.size = 2;
  o.token = kToken;
  o.bind_host = "127.0.0.1";
  o.timeout_seconds = timeout_seconds;
  o.stall_check_seconds = 0;
  o.max_tensor_bytes = 1u << 30;
  std::unique_ptr<Coordinator> coordinator;
  int port = 0;
  CHECK(Coordinator::Start(o, &coordinator, &port).ok());
  Socket honest = JoinAs(port, 0, 2);
  Socket hostile_sock = JoinAs(port, 1, 2);
  const std::string announced = Announcement({Good("w", 100)});
  CHECK(SendAll(honest.fd(), announced.data(), announced.size(), Deadline::After(5), "c").ok());
  const int64_t rss_before = RssBytes();
  const int64_t start = NowNs();
  CHECK(SendAll(hostile_sock.fd(), hostile.data(), hostile.size(), Deadline::After(10), "coordinator").ok());
  if (close_after) hostile_sock.Close();
  MsgType type;
  std::string payload;
  Status st = RecvAfterWelcome(honest.fd(), Deadline::After(timeout_seconds + 5), &type, &payload);
  if (seconds != nullptr) *seconds = (NowNs() - start) / 1e9;
  if (rss_growth != nullptr) *rss_growth = RssBytes() - rss_before;
  CHECK(st.ok());
  if (!st.ok()) return "(nothing received: " + st.message() + ")";
  if (type != MsgType::kFailed) return "(not a failure)";
  WireReader in(payload);
  in.U32();
  return in.Text();
}

}  // namespace

TEST(HostileMemberFramesFailTheJobNamingTheRankAndTheField) {
  WireDesc huge = Good("huge", uint64_t{1} << 61);
  WireDesc bad_dtype = Good("d", 10);
  bad_dtype.dtype = 99;
  WireDesc bad_op = Good("o", 10);
  bad_op.op = 7;
  WireDesc compressed_gather = Good("g", 10);
  compressed_gather.dtype = static_cast<uint32_t>(DType::kFloat32WireFloat16);
  compressed_gather.op = static_cast<uint32_t>(ReduceOp::kGather);
  WireDesc long_name = Good(std::string(300, 'n'), 10);
  WireDesc odd_gather = Good("og", 11);
  odd_gather.op = static_cast<uint32_t>(ReduceOp::kGather);
  WireDesc odd_scatter = Good("os", 11);
  odd_scatter.op = static_cast<uint32_t>(ReduceOp::kReduceScatter);
  WireWriter unknown_id;
  unknown_id.U32(1);
  unknown_id.U8(1);
  unknown_id.U32(5);
  WireWriter endless;  // claims 4 billion entries
  endless.U32(0xffffffffu);
  const std::string equal = Weights({1.0, 1.0});
  struct Case {
    std::string frame;
    const char* field;
  };
  const std::vector<Case> cases = {
      {RawFrame(2, kMaxFrameBytes + 1, ""), "too large (length field 67108865 bytes"},
      {std::string(200, '\xab'), "bad magic"},
      {RawFrame(99, 0, ""), "rank 1 sent message type 99"},
      {Announcement({huge}), "tensor 'huge' with count 2305843009213693952"},
      {Announcement({bad_dtype}), "with dtype code 99 (not a dtype)"},
      {Announcement({bad_op}), "with op code 7 (not an op)"},
      {Announcement({compressed_gather}), "op code 2 for dtype code 9 (a compression of sums only)"},
      {Announcement({long_name}), "a name of 300 bytes"},
      {Announcement({odd_gather}), "allgather 'og' with count 11 (not a multiple of the 2 ranks' rows)"},
      {Announcement({odd_scatter}), "reducescatter 'os' with count 11 (not a multiple of the 2 ranks' rows)"},
      {Announcement({Good("b", 10)}, false), "announced tensor 'b' before its lane weights"},
      {Weights({1.0, std::nan("")}), "sent lane weights with entry 1 = nan (each must be finite and > 0)"},
      {Weights({0.0, 1.0}), "sent lane weights with entry 0 = 0 (each must be finite and > 0)"},
      {Weights({-1.0, 1.0}), "sent lane weights with entry 0 = -1"},
      {Weights({1.0, INFINITY}), "sent lane weights with entry 1 = inf"},
      {Weights({1e308, 1e308}), "sent lane weights with a sum of inf"},
      {Weights({}), "sent lane weights with 0 entries (1..64 allowed)"},
      {Weights(std::vector<double>(65, 1.0)), "sent lane weights with 65 entries (1..64 allowed)"},
      {equal + Weights({1.0, 1.0, 1.0}), "sent lane weights with 3 entries for 2 lanes"},
      {endless.Frame(MsgType::kWeights), "malformed lane weights from rank 1 (cut short)"},
      {equal + unknown_id.Frame(MsgType::kAnnounce), "used unknown id 5 (0 known)"},
      {equal + endless.Frame(MsgType::kAnnounce), "malformed announcement from rank 1 (cut short)"},
  };
  for (const Case& c : cases) {
    double seconds = 0;
    const std::string failure = CoordinatorFacesHostileMember(c.frame, false, 5, &seconds);
    std::printf("    %.2f s: %s\n", seconds, failure.c_str());
    CHECK(failure.find("rank 1") != std::string::npos);
    CHECK(failure.find(c.field) != std::string::npos);
    CHECK(seconds < 2.0);
  }
}

TEST(HostileMemberTruncatedFrameFailsWithinTheTimeoutWithoutCommittingItsLength) {
  // 60 MiB promised, 10 bytes sent: closed at once, or silent until the timeout.
  const std::string cut = RawFrame(2, 60u << 20, std::string(10, '\0'));
  double seconds = 0;
  int64_t growth = 0;
  std::string failure = CoordinatorFacesHostileMember(cut, true, 5, &seconds, &growth);
  std::printf("    %.2f s, RSS %+lld KiB: %s\n", seconds, static_cast<long long>(growth >> 10), failure.c_str());
  CHECK(failure.find("rank 1 broke the negotiation protocol") != std::string::npos);
  CHECK(failure.find("cut short after 0 of 62914560 payload bytes") != std::string::npos);
  CHECK(seconds < 2.0 && growth < (16 << 20));
  failure = CoordinatorFacesHostileMember(cut, false, 1.5, &seconds, &growth);
  std::printf("    %.2f s, RSS %+lld KiB: %s\n", seconds, static_cast<long long>(growth >> 10), failure.c_str());
  CHECK(failure.find("rank 1 broke the negotiation protocol") != std::string::npos);
  CHECK(failure.find("timed out") != std::string::npos);
  CHECK(seconds > 1.4 && seconds < 3.5 && growth < (16 << 20));
}

TEST(HostileMemberCannotGrowThePendingTableWithoutBound) {
  std::vector<WireDesc> entries;
  for (size_t i = 0; i <= kMaxPendingCollectives; ++i) entries.push_back(Good(Str("t", i), 4));
  const std::string failure = CoordinatorFacesHostileMember(Announcement(entries), false);
  std::printf("    %s\n", failure.c_str());
  CHECK(failure.find("rank 1 submitted tensor") != std::string::npos);
  CHECK(failure.find("(at most 65536)") != std::string::npos);
}

// ------------------------------------------------------------------------------------------------
// A coordinator that holds the token sends hostile run orders to a member.

namespace {

// Runs a fake coordinator that accepts one member, reads its frames up to its first kAnnounce or
// kJoin (its lane weights come first), and answers `hostile`.
// The member (rank 1 of 2, two lanes, no proxies) has submitted a tensor "w" of 100 float32
// elements and, with join, joined; returns what its ticket's wait says.
Status MemberFacesHostileCoordinator(const std::string& hostile, bool join, int64_t* rss_growth = nullptr) {
  Socket listener;
  int port = 0;
  CHECK(Listen("127.0.0.1", 0, &listener, &port).ok());
  std::thread coordinator([&] {
    HandshakeAcceptor acceptor(listener, kToken.data(), 0, "fake coordinator");
    Socket member;
    Deadline deadline = Deadline::After(5);
    while (!member.valid() && !deadline.Expired()) {
      CHECK(acceptor.Step(100, [](const PeerClaim&) { return std::string(); },
                          [&](const PeerClaim&, Socket s) { member = std::move(s); }).ok());
    }
    CHECK(SendFrame(member.fd(), WireWriter().Frame(MsgType::kWelcome), Deadline::After(5), "member").ok());
    MsgType type = MsgType::kWeights;
    std::string payload;
    while (type == MsgType::kWeights) {
      Status st = RecvFrame(member.fd(), Deadline::After(5), "member", &type, &payload);
      CHECK(st.ok());
      if (!st.ok()) break;
    }
    CHECK(SendAll(member.fd(), hostile.data(), hostile.size(), Deadline::After(5), "member").ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  });
  ChannelConfig config;
  config.num_lanes = 2;
  config.rank = 1;
  config.size = 2;
  config.token = kToken;
  config.bind_host = "127.0.0.1";
  std::unique_ptr<ProxyChannel> channel;
  CHECK(ProxyChannel::Create(config, &channel).ok());
  MemberOptions o;
  o.rank = 1;
  o.size = 2;
  o.token = kToken;
  o.coordinator_host = "127.0.0.1";
  o.coordinator_port = port;
  o.timeout_seconds = 5;
  o.max_tensor_bytes = 1u << 30;
  std::unique_ptr<Member> member;
  CHECK(Member::Start(channel.get(), o, &member).ok());
  const int64_t rss_before = RssBytes();
  uint64_t ticket = 0;
  Status st;
  if (join) {
    st = member->Join(&ticket);  // returns when the coordinator acknowledges it, or fails
  } else {
    RequestDesc request;
    request.dtype = static_cast<uint32_t>(DType::kFloat32);
    request.count = 100;
    std::strncpy(request.name, "w", kNameBytes - 1);
    CHECK(member->Submit(request, "100", &ticket).ok());
  }
  if (st.ok()) st = member->Wait(ticket, 5, nullptr);
  if (rss_growth != nullptr) *rss_growth = RssBytes() - rss_before;
  coordinator.join();
  member->Close();
  return st;
}

std::string Responses(const std::function<void(WireWriter&)>& body, uint32_t n) {
  WireWriter w;
  w.U32(n);
  body(w);
  return w.Frame(MsgType::kResponses);
}

}  // namespace

TEST(HostileCoordinatorRunOrdersFailTheMemberNamingTheField) {
  struct Case {
    std::string frame;
    bool join;
    const char* field;
  };
  const std::vector<Case> cases = {
      // An id far ahead would have sized the response cache to 4 billion entries.
      {Responses([](WireWriter& w) { w.U8(1); w.U32(0xfffffff0u); w.U8(1); w.Desc(Good("w", 100)); w.U64s({0, 50, 100}); }, 1),
       false, "described id 4294967280 while 0 ids are known"},
      {Responses([](WireWriter& w) { w.U8(1); w.U32(3); w.U8(0); w.U64s({0, 50, 100}); }, 1), false,
       "ran unknown id 3 (0 known)"},
      {Responses([](WireWriter& w) { w.U8(1); w.U32(0); w.U8(1); w.Desc(Good("w", 100)); w.U64s({0, 100}); }, 1),
       false, "have 2 entries for 2 lanes"},
      {Responses([](WireWriter& w) { w.U8(1); w.U32(0); w.U8(1); w.Desc(Good("w", 100)); w.U64s({0, 50, 99}); }, 1),
       false, "end at 99, not at its count 100"},
      {Responses([](WireWriter& w) { w.U8(1); w.U32(0); w.U8(1); w.Desc(Good("w", 101)); w.U64s({0, 50, 101}); }, 1),
       false, "ran tensor 'w' with 101 elements; rank 1 submitted 100"},
      // A joined rank would have allocated a zero buffer of 2^61 elements.
      {Responses([](WireWriter& w) { WireDesc d = Good("x", uint64_t{1} << 61); w.U8(1); w.U32(0); w.U8(1); w.Desc(d); w.U64s({0, 1, d.count}); }, 1),
       true, "tensor 'x' with count 2305843009213693952"},
      {Responses([](WireWriter& w) { w.U8(3); w.U32(7); }, 1), true, "named rank 7 the last to join, of 2 ranks"},
      {Responses([](WireWriter& w) { w.U8(4); w.U32(7); }, 1), true, "recorded the join of rank 7, of 2 ranks"},
      {Responses([](WireWriter& w) { w.U8(9); }, 1), false, "unknown response type"},
      {Responses([](WireWriter&) {}, 5), false, "malformed response batch from the coordinator (rank 0) (cut short)"},
      {RawFrame(5, kMaxFrameBytes + 1, ""), false, "too large"},
      {RawFrame(5, 1000, "abc"), false, "lost the coordinator"},
  };
  for (const Case& c : cases) {
    int64_t growth = 0;
    Status st = MemberFacesHostileCoordinator(c.frame, c.join, &growth);
    std::printf("    RSS %+lld KiB: %s\n", static_cast<long long>(growth >> 10), Report(st).c_str());
    CHECK(!st.ok());
    CHECK(Contains(st, c.field));
    CHECK(growth < (16 << 20));
  }
}
