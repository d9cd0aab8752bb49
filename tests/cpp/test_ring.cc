// The ring schedule: chunk bounds, segment counts, exact sums and the allgather, over real sockets.
#include <cstdint>
#include <vector>

#include "collectives/ring.h"
#include "loopback.h"

using namespace fasthorovod;
using fhtest::ConnectRing;
using fhtest::Options;
using fhtest::RunRanks;

TEST(ChunksCoverTheShardAndSpreadTheTail) {
  for (size_t count : {0, 1, 3, 10, 17, 1000, 1001}) {
    for (uint32_t size = 1; size <= 7; ++size) {
      CHECK_EQ(ChunkBegin(count, size, 0), 0u);
      CHECK_EQ(ChunkBegin(count, size, size), count);
      size_t lo = SIZE_MAX, hi = 0;
      for (uint32_t c = 0; c < size; ++c) {
        const size_t len = ChunkBegin(count, size, c + 1) - ChunkBegin(count, size, c);
        lo = std::min(lo, len);
        hi = std::max(hi, len);
      }
      CHECK(hi - lo <= 1);
    }
  }
  CHECK_EQ(SegmentCount(0, 16), 1u);  // an empty chunk still travels as one frame
  CHECK_EQ(SegmentCount(16, 16), 1u);
  CHECK_EQ(SegmentCount(17, 16), 2u);
  CHECK_EQ(AllgatherOwnChunk(2, 3), 0u);
}

namespace {

template <typename T>
void CheckAllreduce(uint32_t size, size_t count, DType dtype, int sockets, size_t segment_bytes) {
  auto links = ConnectRing(size, sockets);
  std::vector<std::vector<T>> data(size);
  std::vector<T> expected(count, 0);
  for (uint32_t r = 0; r < size; ++r) {
    for (size_t i = 0; i < count; ++i) {
      data[r].push_back(static_cast<T>(static_cast<int>((i * 7 + r * 13) % 101) - 50));
      expected[i] += data[r][i];
    }
  }
  RunRanks(size, [&](uint32_t r) {
    CollectiveDesc desc;
    desc.total_bytes = desc.shard_bytes = count * sizeof(T);
    desc.dtype = static_cast<uint16_t>(dtype);
    RingOptions o;
    static_cast<LaneOptions&>(o) = Options(r, size);
    o.segment_bytes = segment_bytes;
    ShardWork work{data[r].data(), count, dtype, 1.0, 1.0};
    RingStats stats;
    Status st = RingAllreduce(links[r], desc, work, o, &stats);
    CHECK(st.ok());
    if (!st.ok()) std::fprintf(stderr, "    rank %u: %s\n", r, st.message().c_str());
  });
  for (uint32_t r = 0; r < size; ++r) CHECK(data[r] == expected);
}

}  // namespace

TEST(RingAllreduceSumsExactly) {
  for (uint32_t size = 1; size <= 5; ++size) {
    for (size_t count : {0, 1, 3, 4, 1000, 100003}) {  // includes count < size
      const int sockets = 1 + static_cast<int>((size + count) % 3);
      CheckAllreduce<float>(size, count, DType::kFloat32, sockets, 4096);
      CheckAllreduce<int32_t>(size, count, DType::kInt32, sockets, 1000);
    }
  }
}

TEST(RingAllgatherDeliversEveryRanksChunk) {
  for (uint32_t size = 1; size <= 5; ++size) {
    for (size_t width : {0, 1, 7, 5000}) {
      auto links = ConnectRing(size, 2);
      const size_t count = width * size;
      std::vector<std::vector<int32_t>> data(size, std::vector<int32_t>(count, -1));
      std::vector<int32_t> expected(count);
      for (uint32_t r = 0; r < size; ++r) {
        const size_t own = AllgatherOwnChunk(r, size) * width;
        for (size_t i = 0; i < width; ++i) data[r][own + i] = expected[own + i] = static_cast<int32_t>(r * 100000 + i);
      }
      RunRanks(size, [&](uint32_t r) {
        CollectiveDesc desc;
        desc.total_bytes = desc.shard_bytes = count * 4;
        desc.dtype = static_cast<uint16_t>(DType::kInt32);
        desc.op = static_cast<uint16_t>(ReduceOp::kGather);
        RingOptions o;
        static_cast<LaneOptions&>(o) = Options(r, size);
        o.segment_bytes = 4096;
        ShardWork work{data[r].data(), count, DType::kInt32, 3.0, 0.5};  // scales are ignored
        RingStats stats;
        CHECK(RingAllreduce(links[r], desc, work, o, &stats).ok());
      });
      for (uint32_t r = 0; r < size; ++r) CHECK(data[r] == expected);
    }
  }
}
