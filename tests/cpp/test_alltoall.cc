// The mesh alltoall (collectives/alltoall.h) over loopback: ranks as threads, meshes connected as
// the proxies connect them (EstablishMesh's handshakes).
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "collectives/alltoall.h"
#include "common/clock.h"
#include "harness.h"
#include "loopback.h"

using namespace fasthorovod;
using fhtest::RunRanks;

namespace {

// Connects lane `lane`'s mesh of `size` ranks with `sockets` sockets per peer.
std::vector<std::vector<RingLinks>> ConnectMesh(uint32_t size, int sockets, uint32_t lane = 0) {
  std::vector<Socket> listeners(size);
  std::vector<RingEndpoint> peers(size);
  for (uint32_t r = 0; r < size; ++r) {
    int port = 0;
    CHECK(Listen("127.0.0.1", 0, &listeners[r], &port).ok());
    peers[r] = {"127.0.0.1", {port}};
  }
  std::vector<std::vector<RingLinks>> mesh(size);
  RunRanks(size, [&](uint32_t r) {
    LinkIdentity self;
    std::memset(self.token, 7, kTokenBytes);
    self.rank = r;
    self.size = size;
    self.lane = lane;
    Status st = EstablishMesh(self, listeners[r], peers, sockets, 0, Deadline::After(10.0), &mesh[r]);
    CHECK(st.ok());
  });
  return mesh;
}

// Elements rank s sends rank d: uneven, some empty.
uint64_t Count(uint32_t s, uint32_t d, uint32_t size) { return (s * 7 + d * 3) % (size + 2) == 0 ? 0 : 1000 + 37 * s + 11 * d; }
int32_t Value(uint32_t s, uint32_t d, uint64_t i) { return static_cast<int32_t>(s * 100'000'000 + d * 1'000'000 + i); }

RingOptions AlltoallOptions(uint32_t rank, uint32_t size, uint32_t lane) {
  RingOptions o;
  static_cast<LaneOptions&>(o) = fhtest::Options(rank, size, 10.0);
  o.lane = lane;
  o.segment_bytes = 1024;  // several segments per block, over every socket
  return o;
}

// Runs an alltoall of uneven splits over `lanes` lanes (threads, all at once, as the proxies run),
// `adjust(rank, lane, work)` setting up each lane's work further and `done(rank, lane)` told when
// that lane's alltoall returned, checks that every rank received every block and returns each
// (rank, lane)'s statistics.
std::vector<std::vector<RingStats>> CheckAlltoall(
    uint32_t size, int sockets, uint32_t lanes,
    const std::function<void(uint32_t, uint32_t, AlltoallWork*)>& adjust = nullptr,
    const std::function<void(uint32_t, uint32_t)>& done = nullptr) {
  std::vector<std::vector<std::vector<RingLinks>>> meshes;
  for (uint32_t j = 0; j < lanes; ++j) meshes.push_back(ConnectMesh(size, sockets, j));
  std::vector<std::vector<int32_t>> send(size), recv(size);
  std::vector<std::vector<uint64_t>> send_count(size), recv_count(size);
  std::vector<std::vector<uint64_t>> claims(size, std::vector<uint64_t>(size, 0));  // a rank's lanes share them
  for (uint32_t r = 0; r < size; ++r) {
    for (uint32_t d = 0; d < size; ++d) {
      send_count[r].push_back(Count(r, d, size));
      recv_count[r].push_back(Count(d, r, size));
      for (uint64_t i = 0; i < Count(r, d, size); ++i) send[r].push_back(Value(r, d, i));
    }
    size_t received = 0;
    for (uint64_t c : recv_count[r]) received += c;
    recv[r].assign(received, -1);
  }
  std::vector<std::vector<RingStats>> stats(size, std::vector<RingStats>(lanes));
  RunRanks(size * lanes, [&](uint32_t t) {
    const uint32_t r = t % size, j = t / size;
    AlltoallWork work;
    work.send = reinterpret_cast<const char*>(send[r].data());
    work.recv = reinterpret_cast<char*>(recv[r].data());
    work.send_count = send_count[r];
    work.recv_count = recv_count[r];
    work.dtype = DType::kInt32;
    work.lanes = lanes;
    work.lane = j;
    work.claimed = claims[r].data();
    if (adjust) adjust(r, j, &work);
    CollectiveDesc desc;
    desc.op = static_cast<uint16_t>(ReduceOp::kAlltoall);
    desc.dtype = static_cast<uint16_t>(DType::kInt32);
    Status st = MeshAlltoall(meshes[j][r], desc, work, AlltoallOptions(r, size, j), &stats[r][j]);
    CHECK(st.ok());
    if (done) done(r, j);
  });
  for (uint32_t r = 0; r < size; ++r) {
    size_t at = 0;
    for (uint32_t s = 0; s < size; ++s) {
      for (uint64_t i = 0; i < recv_count[r][s]; ++i, ++at) {
        // a rank's block for itself is its worker's to copy: the proxies leave it alone
        const int32_t want = s == r ? -1 : Value(s, r, i);
        if (recv[r][at] != want) {
          CHECK_EQ(recv[r][at], want);
          return stats;
        }
      }
    }
  }
  return stats;
}

}  // namespace

TEST(AlltoallSendRegionStartsAfterTheTableOnA64ByteBoundary) {
  // sent to each, received from each, receive buffer, its offset, the staged word, the claim words
  CHECK_EQ(AlltoallTableWords(3), size_t{12});
  CHECK_EQ(AlltoallStagedWord(3), size_t{8});
  CHECK_EQ(AlltoallClaimWord(3), size_t{9});
  CHECK_EQ(AlltoallSendOffset(3), size_t{128});  // 96 bytes of table
  CHECK_EQ(AlltoallSendOffset(2), size_t{128});  // 72 bytes
  CHECK_EQ(AlltoallSendOffset(1), size_t{64});   // 48 bytes
}

TEST(MeshAlltoallDeliversEveryBlockOfUnevenSplits) {
  CheckAlltoall(2, 1, 1);
  CheckAlltoall(3, 2, 2);
  CheckAlltoall(4, 2, 3);
}

TEST(TheLanesOfARankShareEachBlockByWhatTheyCanCarry) {
  // lane 0 of every rank may send only once lane 1 of every rank is done (its gate opens then):
  // lane 1 has claimed and sent every segment of every block, lane 0 sends none (with fixed parts,
  // lane 0 would still carry its half of each block, once open); every block still arrives whole
  std::vector<uint64_t> late(4, 0), open(4, 3);
  std::atomic<uint32_t> lane1_done{0};
  auto stats = CheckAlltoall(
      4, 2, 2, [&](uint32_t r, uint32_t j, AlltoallWork* work) { work->staged = j == 0 ? &late[r] : &open[r]; },
      [&](uint32_t, uint32_t j) {
        if (j == 1 && ++lane1_done == 4) {
          for (auto& word : late) __atomic_store_n(&word, 3, __ATOMIC_RELEASE);
        }
      });
  for (uint32_t r = 0; r < 4; ++r) {
    CHECK_EQ(stats[r][0].bytes_sent, uint64_t{0});
    CHECK(stats[r][1].bytes_sent > 0);
    CHECK_EQ(stats[r][0].bytes_received, uint64_t{0});
  }
}

TEST(AFailedAlltoallStepReachesEveryRankAtOnce) {
  // rank 0 aborts before its first step: every other rank, whichever step it waits in, fails with
  // rank 0's reason well before the 10 s timeout, never hangs
  const uint32_t size = 4;
  auto mesh = ConnectMesh(size, 1);
  std::vector<std::vector<int32_t>> send(size, std::vector<int32_t>(size * 5000, 1)), recv = send;
  std::vector<Status> results(size);
  std::vector<std::vector<uint64_t>> claims(size, std::vector<uint64_t>(size, 0));
  std::atomic<uint32_t> abort{1};
  const char* reason = "rank 0 gave up";
  const auto start = std::chrono::steady_clock::now();
  RunRanks(size, [&](uint32_t r) {
    AlltoallWork work;
    work.send = reinterpret_cast<const char*>(send[r].data());
    work.recv = reinterpret_cast<char*>(recv[r].data());
    work.send_count.assign(size, 5000);
    work.recv_count.assign(size, 5000);
    work.dtype = DType::kInt32;
    work.claimed = claims[r].data();
    RingOptions o = AlltoallOptions(r, size, 0);
    if (r == 0) {
      o.abort = &abort;
      o.abort_reason = reason;
    }
    CollectiveDesc desc;
    desc.op = static_cast<uint16_t>(ReduceOp::kAlltoall);
    RingStats stats;
    results[r] = MeshAlltoall(mesh[r], desc, work, o, &stats);
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(seconds < 5.0);
  for (uint32_t r = 0; r < size; ++r) {
    CHECK(!results[r].ok());
    CHECK(results[r].message().find("rank 0 gave up") != std::string::npos);
  }
}

namespace {

// Every rank's worker stages its blocks one by one, in distance order, `pause_ms` apart, publishing
// each in its staged word while the mesh runs; rank `failing` publishes a failure instead, rank
// `stalling` stops after its first block. `before_staging(rank)`, if set, runs on each rank's
// worker first.
std::vector<Status> RunStaged(uint32_t size, int pause_ms, uint32_t failing, std::vector<std::vector<int32_t>>* recv,
                              uint32_t stalling = ~0u, double timeout_seconds = 10.0,
                              const std::function<void(uint32_t)>& before_staging = nullptr) {
  const uint64_t block = 3000;
  auto mesh = ConnectMesh(size, 2);
  std::vector<std::vector<int32_t>> send(size, std::vector<int32_t>(size * block, -7));  // not staged yet
  recv->assign(size, std::vector<int32_t>(size * block, -1));
  std::vector<uint64_t> staged(size, 0);
  std::vector<std::vector<uint64_t>> claims(size, std::vector<uint64_t>(size, 0));
  std::vector<Status> results(size);
  RunRanks(2 * size, [&](uint32_t t) {
    const uint32_t r = t % size;
    if (t >= size) {  // the worker
      if (before_staging) before_staging(r);
      for (uint32_t d = 1; d < size; ++d) {
        std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
        if (r == failing) {
          __atomic_store_n(&staged[r], kAlltoallStagingFailed, __ATOMIC_RELEASE);
          return;
        }
        if (r == stalling && d > 1) return;
        const uint32_t to = (r + d) % size;
        for (uint64_t i = 0; i < block; ++i) send[r][to * block + i] = Value(r, to, i);
        __atomic_store_n(&staged[r], d, __ATOMIC_RELEASE);
      }
      return;
    }
    AlltoallWork work;
    work.send = reinterpret_cast<const char*>(send[r].data());
    work.recv = reinterpret_cast<char*>((*recv)[r].data());
    work.send_count.assign(size, block);
    work.recv_count.assign(size, block);
    work.dtype = DType::kInt32;
    work.staged = &staged[r];
    work.claimed = claims[r].data();
    RingOptions o = AlltoallOptions(r, size, 0);
    o.timeout_seconds = timeout_seconds;
    CollectiveDesc desc;
    desc.op = static_cast<uint16_t>(ReduceOp::kAlltoall);
    RingStats stats;
    results[r] = MeshAlltoall(mesh[r], desc, work, o, &stats);
  });
  return results;
}

}  // namespace

TEST(AnAlltoallStepSendsItsBlockOnlyOnceStaged) {
  // blocks staged 30 ms apart while the steps run: every step waited for its own block (a block
  // sent before it was staged would arrive as -7)
  const uint32_t size = 4;
  std::vector<std::vector<int32_t>> recv;
  for (const Status& st : RunStaged(size, 30, size, &recv)) CHECK(st.ok());
  for (uint32_t r = 0; r < size; ++r) {
    for (uint32_t s = 0; s < size; ++s) {
      for (uint64_t i = 0; i < 3000; ++i) {
        if (recv[r][s * 3000 + i] != (s == r ? -1 : Value(s, r, i))) {
          CHECK_EQ(recv[r][s * 3000 + i], s == r ? -1 : Value(s, r, i));
          return;
        }
      }
    }
  }
}

TEST(AWorkerThatCannotStageFailsTheAlltoallOnEveryRank) {
  const uint32_t size = 3;
  std::vector<std::vector<int32_t>> recv;
  const auto start = std::chrono::steady_clock::now();
  std::vector<Status> results = RunStaged(size, 5, 1, &recv);
  CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < 5.0);
  for (const Status& st : results) {
    CHECK(!st.ok());
    CHECK(st.message().find("rank 1's worker could not stage its alltoall rows") != std::string::npos);
  }
}

TEST(AnAlltoallWaitsForStagingAtMostTheTimeout) {
  // rank 2's worker stages one block of two and stops: its step of distance 2 gives up after the
  // 1 s timeout, naming what it waited for, and so does rank 1, which waits for that block (rank 0
  // has every block it needs: its alltoall completes)
  const uint32_t size = 3;
  std::vector<std::vector<int32_t>> recv;
  const auto start = std::chrono::steady_clock::now();
  std::vector<Status> results = RunStaged(size, 5, size, &recv, 2, 1.0);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(seconds >= 0.9 && seconds < 5.0);
  CHECK(results[0].ok());
  for (uint32_t r : {1u, 2u}) {
    CHECK(results[r].code() == Code::kTimeout);
    CHECK(results[r].message().find("rank 2's worker staged 1 of its 2 alltoall blocks in 1 s") != std::string::npos);
  }
}

TEST(AnAlltoallStepReceivesWhileItsBlockIsNotStaged) {
  // rank 0's worker stages nothing until every block for rank 0 has arrived: its steps receive
  // while their sends wait (before, a step waited for its block before it received, and rank 0's
  // worker would wait its 5 s out here)
  const uint32_t size = 3;
  const uint64_t block = 3000;
  std::vector<std::vector<int32_t>> recv;
  std::atomic<bool> arrived_first{false};
  auto wait_for_blocks = [&](uint32_t r) {
    if (r != 0) return;
    auto all_in = [&] {
      for (uint64_t i = block; i < size * block; ++i) {  // every block but rank 0's own
        if (__atomic_load_n(&recv[0][i], __ATOMIC_ACQUIRE) == -1) return false;
      }
      return true;
    };
    const int64_t until = NowNs() + 5'000'000'000;
    while (!all_in() && NowNs() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    arrived_first = all_in();
  };
  for (const Status& st : RunStaged(size, 0, size, &recv, ~0u, 10.0, wait_for_blocks)) CHECK(st.ok());
  CHECK(arrived_first.load());
  for (uint32_t r = 0; r < size; ++r) {
    for (uint32_t s = 0; s < size; ++s) {
      if (s != r) CHECK_EQ(recv[r][s * block + 1], Value(s, r, 1));
    }
  }
}
