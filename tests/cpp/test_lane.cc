// The lane transport on its own: striping, end markers, aborts, deadlines, mismatches, peeking.
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <set>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "collectives/ring.h"
#include "common/clock.h"
#include "loopback.h"

using namespace fasthorovod;
using fhtest::ConnectRing;
using fhtest::Options;
using fhtest::RunRanks;

namespace {

// Every rank sends `frames` frames of `frame_bytes` (its own bytes) to the next rank and receives
// as many from the previous rank into `received`; nothing is forwarded.
class Exchange : public FrameSink {
 public:
  Exchange(size_t frames, size_t frame_bytes) : frames_(frames), frame_bytes_(frame_bytes),
                                                 received(frames * frame_bytes, 0), seen(frames, 0) {}
  Status Accept(const Frame& f, size_t, char** payload) override {
    if (f.segment >= frames_ || f.offset != f.segment * frame_bytes_ || f.length != frame_bytes_) {
      return Status::Error(Code::kIoError, "unexpected frame");
    }
    *payload = received.data() + f.offset;
    return Status::Ok();
  }
  void Received(const Frame& f, size_t) override { seen[f.segment]++; }
  void SendAll(Lane& lane, const std::vector<char>& mine) {
    for (size_t i = 0; i < frames_; ++i) {
      Frame f;
      f.segment = static_cast<uint32_t>(i);
      f.offset = i * frame_bytes_;
      f.length = frame_bytes_;
      lane.Send(f, mine.data() + f.offset);
    }
  }
  size_t frames_, frame_bytes_;
  std::vector<char> received;
  std::vector<int> seen;
};

class SocketCounter : public FrameObserver {
 public:
  int64_t OnFrame(const CollectiveDesc&, const FrameEvent& e) override {
    std::lock_guard<std::mutex> lock(mutex);
    (e.send ? sent_on : received_on).insert(e.socket);
    if (e.send) sent_count[e.socket]++;
    return next_id++;
  }
  std::mutex mutex;
  std::set<size_t> sent_on, received_on;
  std::map<size_t, size_t> sent_count;
  int64_t next_id = 0;
};

std::vector<char> Pattern(uint32_t rank, size_t bytes, uint32_t salt = 0) {
  std::vector<char> v(bytes);
  for (size_t i = 0; i < bytes; ++i) v[i] = static_cast<char>((i * 31 + rank * 7 + salt * 13) & 0xff);
  return v;
}

// One float32 ring allreduce of `count` ones on this rank's links.
Status RingSum(RingLinks& links, const CollectiveDesc& desc, const RingOptions& o, size_t count) {
  std::vector<float> data(count, 1.0f);
  ShardWork work{data.data(), count, DType::kFloat32, 1.0, 1.0};
  RingStats stats;
  return RingAllreduce(links, desc, work, o, &stats);
}

CollectiveDesc Desc(uint64_t seq) {
  CollectiveDesc d;
  d.seq = seq;
  d.name_hash = 0xabc;
  d.total_bytes = d.shard_bytes = 1000;
  d.dtype = static_cast<uint16_t>(DType::kFloat32);
  std::strncpy(d.name, "grad", kWireNameBytes - 1);
  return d;
}

// One collective on `lane`: this rank's pattern for `seq` goes out in x's frames, the previous
// rank's arrives in `x`.
Status ExchangeOnce(Lane& lane, uint32_t rank, uint64_t seq, Exchange& x, LaneStats* stats) {
  CollectiveDesc desc = Desc(seq);
  std::vector<char> mine = Pattern(rank, x.frames_ * x.frame_bytes_, static_cast<uint32_t>(seq));
  lane.Begin(desc, x.frames_, x.frames_);
  x.SendAll(lane, mine);
  return lane.Run(&x, stats);
}

// Every rank of a ring of `size` sends `frames` frames of `frame_bytes` to the next rank over
// `sockets` sockets (buffers fixed at `buffer_bytes`, 0: autotuned), checking what arrives and the
// lane's counts; returns each rank's per-socket record of the frames.
std::vector<SocketCounter> ExchangeOverSockets(uint32_t size, int sockets, int buffer_bytes, size_t frames,
                                               size_t frame_bytes) {
  auto links = ConnectRing(size, sockets, buffer_bytes);
  std::vector<SocketCounter> counters(size);
  RunRanks(size, [&](uint32_t r) {
    LaneOptions o = Options(r, size);
    o.observer = &counters[r];
    CollectiveDesc desc = Desc(0);
    Lane lane(links[r], o);
    Exchange x(frames, frame_bytes);
    std::vector<char> mine = Pattern(r, frames * frame_bytes);
    lane.Begin(desc, frames, frames);
    x.SendAll(lane, mine);
    LaneStats stats;
    Status st = lane.Run(&x, &stats);
    CHECK(st.ok());
    CHECK(x.received == Pattern((r + size - 1) % size, frames * frame_bytes));
    for (int n : x.seen) CHECK_EQ(n, 1);
    CHECK_EQ(stats.frames_sent, frames);
    CHECK_EQ(stats.frames_received, frames);
    CHECK_EQ(stats.bytes_sent, frames * (frame_bytes + kFrameHeaderBytes));
  });
  return counters;
}

}  // namespace

TEST(LaneStripesFramesOverEverySocket) {
  for (int sockets = 1; sockets <= 3; ++sockets) {
    // 12 MiB per rank through 64 KiB buffers
    for (auto& c : ExchangeOverSockets(3, sockets, 64 << 10, 48, 256 << 10)) {
      CHECK_EQ(c.sent_on.size(), static_cast<size_t>(sockets));  // every socket carried frames
      CHECK_EQ(c.received_on.size(), static_cast<size_t>(sockets));
    }
  }
}

// With the kernel's autotuned send buffers (megabytes), the first socket would accept every frame
// of a small collective and the others' flows would idle: the lane gives each frame to the socket
// with the least left to send, so every socket carries frames. How evenly depends on how the
// receiving thread drains each socket (a socket it reads less often keeps a backlog and is given
// fewer frames, by design), which a loaded machine decides, so the check is that no socket idles
// and none took them all.
TEST(LaneSpreadsFramesWhenEverySocketWouldTakeThemAll) {
  for (int sockets = 2; sockets <= 4; sockets += 2) {
    const size_t frames = 16;  // of 128 KiB: 2 MiB per rank, which one autotuned buffer holds
    for (auto& c : ExchangeOverSockets(2, sockets, 0, frames, 128 << 10)) {
      for (int s = 0; s < sockets; ++s) {
        CHECK(c.sent_count[s] >= 1);
        CHECK(c.sent_count[s] < frames);
      }
    }
  }
}

TEST(LaneEndMarkersKeepBackToBackCollectivesApart) {
  // Collective A has fewer frames than sockets (some sockets carry only an end marker); B follows
  // at once. If a receiver read into the next collective, the header check would fail (seq) or
  // the payload would be wrong.
  const uint32_t size = 2;
  const int sockets = 3;
  auto links = ConnectRing(size, sockets);
  RunRanks(size, [&](uint32_t r) {
    Lane lane(links[r], Options(r, size));
    for (uint64_t seq = 0; seq < 6; ++seq) {
      const size_t frames = seq % 2 == 0 ? 1 : 7;
      const size_t frame_bytes = 4096 + seq;
      Exchange x(frames, frame_bytes);
      LaneStats stats;
      Status st = ExchangeOnce(lane, r, seq, x, &stats);
      CHECK(st.ok());
      if (!st.ok()) std::fprintf(stderr, "    %s\n", st.message().c_str());
      CHECK(x.received == Pattern(1 - r, frames * frame_bytes, static_cast<uint32_t>(seq)));
    }
  });
}

int LocalPort(const Socket& sock) {
  sockaddr_in addr{};
  socklen_t len = sizeof(addr);
  CHECK(getsockname(sock.fd(), reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  return ntohs(addr.sin_port);
}

int PeerPort(const Socket& sock) {
  sockaddr_in addr{};
  socklen_t len = sizeof(addr);
  CHECK(getpeername(sock.fd(), reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  return ntohs(addr.sin_port);
}

// Re-hashing: a sender announces sockets in a collective's end markers, the receiver learns which,
// and between two collectives both swap those connections for new ones (new source ports, and
// the next rank's other listening port: odd sockets start on its second port, even ones on its
// first, and each replacement goes to the other), with every frame of every collective arriving
// intact, whichever sockets each rank replaces.
TEST(LaneRehashReplacesTheAnnouncedSocketsBetweenCollectives) {
  const uint32_t size = 3;
  const int sockets = 3;
  fhtest::RingSetup setup;
  auto links = ConnectRing(size, sockets, 64 << 10, &setup);
  std::vector<std::vector<SocketCounters>> counters(size);
  for (auto& c : counters) c = std::vector<SocketCounters>(sockets);
  auto announced = [](uint64_t seq, uint32_t rank) -> uint64_t {  // by rank r in collective seq
    if (seq == 4) return 0b111;                                   // every socket at once
    return seq % 2 == 0 ? uint64_t{1} << ((seq + rank) % sockets) : 0;
  };
  RunRanks(size, [&](uint32_t r) {
    const uint32_t prev = (r + size - 1) % size;
    uint64_t bytes = 0;
    for (uint64_t seq = 0; seq < 7; ++seq) {
      const size_t frames = 24, frame_bytes = 64 << 10;
      LaneOptions o = Options(r, size);
      o.socket_counters = counters[r].data();
      o.rehash_out = announced(seq, r);
      Lane lane(links[r], o);
      Exchange x(frames, frame_bytes);
      LaneStats stats;
      Status st = ExchangeOnce(lane, r, seq, x, &stats);
      CHECK(st.ok());
      CHECK(x.received == Pattern(prev, frames * frame_bytes, static_cast<uint32_t>(seq)));
      CHECK_EQ(stats.rehash_in, announced(seq, prev));
      bytes += stats.bytes_sent;
      std::vector<uint32_t> out, in;
      std::vector<int> ports_before, peer_ports_before;
      const RingEndpoint next = setup.Next(r);
      for (uint32_t s = 0; s < sockets; ++s) {
        ports_before.push_back(LocalPort(links[r].to_next[s]));
        peer_ports_before.push_back(PeerPort(links[r].to_next[s]));
        if (seq == 0) CHECK_EQ(peer_ports_before[s], next.ports[s % 2]);
        if ((o.rehash_out >> s) & 1) out.push_back(s);
        if ((stats.rehash_in >> s) & 1) in.push_back(s);
      }
      if (out.empty() && in.empty()) continue;
      st = ConnectRingSockets(setup.Identity(r), setup.Listeners(r), setup.Next(r), out, in, sockets, 64 << 10,
                              Deadline::After(10.0), &links[r]);
      CHECK(st.ok());
      if (!st.ok()) std::fprintf(stderr, "    %s\n", st.message().c_str());
      for (uint32_t s = 0; s < sockets; ++s) {
        const bool replaced = std::find(out.begin(), out.end(), s) != out.end();
        CHECK_EQ(LocalPort(links[r].to_next[s]) != ports_before[s], replaced);
        const int peer_port = PeerPort(links[r].to_next[s]);
        CHECK(peer_port == next.ports[0] || peer_port == next.ports[1]);
        CHECK_EQ(peer_port != peer_ports_before[s], replaced);
      }
    }
    uint64_t counted = 0;
    for (auto& c : counters[r]) counted += c.bytes_sent.load();
    CHECK_EQ(counted, bytes);  // the sockets' counters add up to the lane's
  });
}

// A rank that listens on several ports (the path probe's eight) gets socket s on its port
// s % ports, and a replacement on the port after its predecessor's, round the list.
TEST(RingSocketsSpreadOverTheNextRanksPortsAndMoveOnWhenReplaced) {
  const uint32_t size = 2;
  const int sockets = 5;
  const size_t num_ports = 3;
  std::vector<std::vector<Socket>> listeners(size);
  std::vector<std::vector<int>> ports(size, std::vector<int>(num_ports));
  for (uint32_t r = 0; r < size; ++r) {
    listeners[r].resize(num_ports);
    for (size_t i = 0; i < num_ports; ++i) CHECK(Listen("127.0.0.1", 0, &listeners[r][i], &ports[r][i]).ok());
  }
  auto identity = [&](uint32_t r) {
    LinkIdentity self;
    std::memset(self.token, 7, kTokenBytes);
    self.rank = r;
    self.size = size;
    return self;
  };
  auto next = [&](uint32_t r) { return RingEndpoint{"127.0.0.1", ports[(r + 1) % size]}; };
  std::vector<RingLinks> links(size);
  RunRanks(size, [&](uint32_t r) {
    CHECK(EstablishRing(identity(r), RingListeners(listeners[r]), next(r), sockets, 0, Deadline::After(10.0),
                        &links[r]).ok());
  });
  for (uint32_t r = 0; r < size; ++r) {
    for (int s = 0; s < sockets; ++s) CHECK_EQ(PeerPort(links[r].to_next[s]), ports[(r + 1) % size][s % num_ports]);
  }
  // Socket 2 (on port 2) moves to port 0, socket 4 (on port 1) to port 2; twice more, socket 2
  // goes round to port 2 again.
  const std::vector<uint32_t> replaced = {2, 4};
  for (int round = 1; round <= 3; ++round) {
    RunRanks(size, [&](uint32_t r) {
      CHECK(ConnectRingSockets(identity(r), RingListeners(listeners[r]), next(r), replaced, replaced, sockets, 0,
                               Deadline::After(10.0), &links[r]).ok());
    });
    for (uint32_t r = 0; r < size; ++r) {
      const std::vector<int>& to = ports[(r + 1) % size];
      CHECK_EQ(PeerPort(links[r].to_next[2]), to[(2 + round) % num_ports]);
      CHECK_EQ(PeerPort(links[r].to_next[4]), to[(1 + round) % num_ports]);
      CHECK_EQ(PeerPort(links[r].to_next[1]), to[1]);
    }
  }
  RingLinks unused;
  Status st = EstablishRing(identity(0), RingListeners(listeners[0]), RingEndpoint{"127.0.0.1", {}}, 1, 0,
                            Deadline::After(1.0), &unused);
  CHECK(st.code() == Code::kInvalidArgument && st.message().find("1 to 255 ports") != std::string::npos);
}

// A connection that announces a socket the receiver does not expect now is refused, and the
// receiver still takes the one it expects.
TEST(LaneRehashTakesOnlyTheExpectedSocket) {
  const uint32_t size = 2;
  const int sockets = 2;
  fhtest::RingSetup setup;
  auto links = ConnectRing(size, sockets, 0, &setup);
  std::thread receiver([&] {  // rank 0 expects socket 1 of rank 1 and nothing else
    CHECK(ConnectRingSockets(setup.Identity(0), setup.Listeners(0), setup.Next(0), {}, {1}, sockets, 0,
                             Deadline::After(10.0), &links[0]).ok());
  });
  {  // first a connection that proves the token but claims socket 0
    Socket sock;
    CHECK(ConnectWithRetry("127.0.0.1", setup.ports[0], Deadline::After(5.0), &sock).ok());
    Status st = AuthenticateToPeer(sock.fd(), setup.Identity(1), LinkPurpose::kRing, 0, 0, Deadline::After(5.0),
                                   "rank 0");
    CHECK(st.code() == Code::kPeerError && st.message().find("not expected") != std::string::npos);
  }
  const int kept = LocalPort(links[1].to_next[0]);
  CHECK(ConnectRingSockets(setup.Identity(1), setup.Listeners(1), setup.Next(1), {1}, {}, sockets, 0,
                           Deadline::After(10.0), &links[1]).ok());
  receiver.join();
  CHECK_EQ(LocalPort(links[1].to_next[0]), kept);
}

TEST(LaneAbortReachesEveryRankWithCodeAndMessage) {
  // A ring (every rank waits on every other), so the abort must travel round to reach everyone.
  // A timeout stays a timeout on every rank; a failure of rank 2's own (its proxy died) is a
  // peer's failure for the others (CodeFromPeer).
  const uint32_t size = 4;
  const char reason[] = "the test pulled the plug";
  const Code cases[][2] = {{Code::kTimeout, Code::kTimeout}, {Code::kProxyDied, Code::kPeerError}};
  for (const auto& c : cases) {
    auto links = ConnectRing(size, 2);
    std::atomic<uint32_t> abort_flag{1};
    const uint32_t abort_code = static_cast<uint32_t>(c[0]);
    std::vector<Status> results(size);
    RunRanks(size, [&](uint32_t r) {
      RingOptions o;
      static_cast<LaneOptions&>(o) = Options(r, size);
      if (r == 2) {
        o.abort = &abort_flag;
        o.abort_reason = reason;
        o.abort_code = &abort_code;
      }
      results[r] = RingSum(links[r], Desc(0), o, 10000);
    });
    for (uint32_t r = 0; r < size; ++r) {
      CHECK_EQ(static_cast<int>(results[r].code()), static_cast<int>(r == 2 ? c[0] : c[1]));
      CHECK(results[r].message().find(reason) != std::string::npos);
      // named once, however many ranks forwarded it (rank 1 hears it from rank 0, which heard it from 3)
      const std::string& message = results[r].message();
      if (r != 2) CHECK(message.find("[reported by rank 2]") != std::string::npos);
      CHECK(message.find("[reported by rank 2]") == message.rfind("[reported by rank 2]"));
    }
  }
}

TEST(LaneSilentNeighbourTimesOut) {
  const uint32_t size = 2;
  auto links = ConnectRing(size, 2);
  // Rank 1 is connected but never runs the collective.
  CollectiveDesc desc = Desc(0);
  Lane lane(links[0], Options(0, size, 0.5));
  Exchange x(2, 1024);
  std::vector<char> mine = Pattern(0, 2 * 1024);
  lane.Begin(desc, 2, 2);
  x.SendAll(lane, mine);
  LaneStats stats;
  const int64_t start = NowNs();
  Status st = lane.Run(&x, &stats);
  const double seconds = (NowNs() - start) / 1e9;
  CHECK_EQ(static_cast<int>(st.code()), static_cast<int>(Code::kTimeout));
  CHECK(st.message().find("waiting for data from rank 1") != std::string::npos);
  CHECK(seconds >= 0.5 && seconds < 1.5);
}

TEST(LaneMismatchIsAMismatchOnEveryRank) {
  for (uint32_t size : {2u, 3u}) {  // with 3 ranks, rank 0 learns of it only from an abort frame
    auto links = ConnectRing(size, 2);
    std::vector<Status> results(size);
    RunRanks(size, [&](uint32_t r) {
      CollectiveDesc desc = Desc(0);
      if (r == 1) desc.shape_hash = 99;  // same name and size, another shape
      RingOptions o;
      static_cast<LaneOptions&>(o) = Options(r, size);
      results[r] = RingSum(links[r], desc, o, 10000);
    });
    for (uint32_t r = 0; r < size; ++r) {
      CHECK_EQ(static_cast<int>(results[r].code()), static_cast<int>(Code::kMismatch));
      CHECK(results[r].message().find("collective mismatch") != std::string::npos);
      CHECK(results[r].message().find("the shapes differ") != std::string::npos);
      CHECK(results[r].message().find("tensor 'grad'") != std::string::npos);
    }
  }
}
