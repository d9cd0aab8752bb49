// The ring schedule: chunk bounds, segment counts, exact sums and the allgather, over real sockets.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
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

TEST(RingWithA16BitWireGivesEveryRankTheSameValuesWithinTheRoundingBound) {
  // float32 in memory, float16 or bfloat16 on the wire: every hop's partial sums are rounded to the
  // wire type and added in float32, so after n-1 hops and the owner's final rounding an element is
  // off the exact sum by at most n * 2^-p * sum(|x_i|) (p = 11 or 8 significand bits), and every
  // rank holds the same values, each representable in the wire type. The frames carry 2 bytes per
  // element: the lane sends half of what the plain float32 ring sends.
  for (DType code : {DType::kFloat32WireFloat16, DType::kFloat32WireBFloat16}) {
    const DType wire = WireDType(code);
    const double unit = wire == DType::kFloat16 ? 1.0 / 2048 : 1.0 / 256;
    for (uint32_t size : {2u, 3u, 5u}) {
      for (size_t count : {1, 7, 100003}) {
        auto links = ConnectRing(size, 2);
        std::vector<std::vector<float>> data(size);
        std::vector<double> exact(count, 0.0), magnitude(count, 0.0);
        for (uint32_t r = 0; r < size; ++r) {
          for (size_t i = 0; i < count; ++i) {
            const float x = static_cast<float>(((i * 7919 + r * 104729) % 20011) / 997.0 - 10.0) * (r % 2 ? 1.0f : 0.37f);
            data[r].push_back(x);
            exact[i] += x;
            magnitude[i] += std::fabs(x);
          }
        }
        std::vector<uint64_t> sent(size);
        RunRanks(size, [&](uint32_t r) {
          CollectiveDesc desc;
          desc.total_bytes = desc.shard_bytes = count * 4;
          desc.dtype = static_cast<uint16_t>(code);
          RingOptions o;
          static_cast<LaneOptions&>(o) = Options(r, size);
          o.segment_bytes = 4096;
          ShardWork work{data[r].data(), count, code, 1.0, 1.0 / size};
          RingStats stats;
          Status st = RingAllreduce(links[r], desc, work, o, &stats);
          CHECK(st.ok());
          if (!st.ok()) std::fprintf(stderr, "    rank %u: %s\n", r, st.message().c_str());
          sent[r] = stats.bytes_sent;
        });
        for (uint32_t r = 0; r < size; ++r) {
          CHECK(data[r] == data[0]);
          // each rank sends 2 (n-1)/n of the tensor at 2 bytes per element, plus 128 bytes of header
          // per frame of 4096: well under the 4 bytes per element of float32
          const double payload = 2.0 * (size - 1) * count * 2 / size;
          if (count > 1000) CHECK(sent[r] >= payload && sent[r] < 1.2 * payload);
        }
        for (size_t i = 0; i < count; ++i) {
          const double error = std::fabs(data[0][i] - exact[i] / size);
          CHECK(error <= unit * magnitude[i] + 1e-7);  // (n-1)/n of it from the hops, 1/n the final rounding
          uint16_t bits[1];
          ToWire(wire, bits, &data[0][i], 1);
          float back;
          FromWire(wire, &back, bits, 1);
          CHECK(back == data[0][i]);  // representable in the wire type
        }
      }
    }
  }
}

TEST(ARingOfOneRoundsACompressedDTypeToItsWireTypeToo) {
  std::vector<float> data = {1.0f / 3, 1000.1f, -2.5f};
  ShardWork work{data.data(), data.size(), DType::kFloat32WireFloat16, 1.0, 2.0};
  ReduceWithoutRing(work, 4096);
  CHECK(data[0] == HalfToFloat(FloatToHalf(2.0f / 3)) && data[0] != 2.0f / 3);
  CHECK(data[1] == 2000.0f && data[2] == -5.0f);  // 2000.2 rounds to 2000 in float16
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

TEST(RingReduceScatterLeavesEachRankItsOwnChunkReducedAndScaled) {
  for (uint32_t size = 1; size <= 5; ++size) {
    for (size_t width : {0, 1, 7, 5000}) {
      auto links = ConnectRing(size, 2);
      const size_t count = width * size;
      std::vector<std::vector<float>> data(size, std::vector<float>(count));
      std::vector<float> sum(count, 0.0f);
      for (uint32_t r = 0; r < size; ++r) {
        for (size_t i = 0; i < count; ++i) {
          data[r][i] = static_cast<float>((r + 1) * (i % 101));
          sum[i] += 3.0f * data[r][i];  // prescale 3
        }
      }
      RunRanks(size, [&](uint32_t r) {
        CollectiveDesc desc;
        desc.total_bytes = desc.shard_bytes = count * 4;
        desc.dtype = static_cast<uint16_t>(DType::kFloat32);
        desc.op = static_cast<uint16_t>(ReduceOp::kReduceScatter);
        RingOptions o;
        static_cast<LaneOptions&>(o) = Options(r, size);
        o.segment_bytes = 4096;
        ShardWork work{data[r].data(), count, DType::kFloat32, 3.0, 0.5};
        RingStats stats;
        CHECK(RingAllreduce(links[r], desc, work, o, &stats).ok());
        // only the reduce-scatter phase ran: size - 1 chunks out and in (every frame counted)
        CHECK(stats.bytes_sent <= (size - 1) * (width * 4 + 4096) + 1 && stats.frames_sent >= size - 1);
      });
      for (uint32_t r = 0; r < size; ++r) {
        const size_t own = AllgatherOwnChunk(r, size) * width;
        for (size_t i = 0; i < width; ++i) CHECK(data[r][own + i] == 0.5f * sum[own + i]);
      }
    }
  }
}

namespace {

// Local rank `me`'s part of a host's L buffers, as the hierarchical allreduce hands it to the ring:
// counts how often each element was reduced in and copied out, and checks the order.
class CountingHost : public HostShare {
 public:
  CountingHost(std::vector<std::vector<float>>& buffers, uint32_t me)
      : buffers_(buffers), me_(me), reduced_(buffers[me].size()), copied_(buffers[me].size()) {}
  void ReduceIn(size_t begin, size_t count) override {
    for (size_t i = begin; i < begin + count; ++i) {
      ++reduced_[i];
      for (uint32_t m = 0; m < buffers_.size(); ++m) {
        if (m != me_) buffers_[me_][i] += buffers_[m][i];
      }
    }
  }
  void CopyOut(size_t begin, size_t count) override {
    for (size_t i = begin; i < begin + count; ++i) {
      if (reduced_[i] != 1) early_ = true;  // a result before its host's contributions
      ++copied_[i];
      for (uint32_t m = 0; m < buffers_.size(); ++m) {
        if (m != me_) buffers_[m][i] = buffers_[me_][i];
      }
    }
  }
  bool EachElementOnce() const {
    for (size_t i = 0; i < reduced_.size(); ++i) {
      if (reduced_[i] != 1 || copied_[i] != 1) return false;
    }
    return !early_;
  }

 private:
  std::vector<std::vector<float>>& buffers_;
  const uint32_t me_;
  std::vector<int> reduced_, copied_;
  bool early_ = false;
};

}  // namespace

// The hierarchical allreduce's use of the ring: every rank's shard is one local rank's part of its
// host's L buffers; the others' contributions are added only through ReduceIn, and the other
// buffers get the result only through CopyOut. Every buffer of every host must end with the sum of
// all H·L buffers (postscaled), each element reduced in and copied out exactly once.
TEST(RingAddsTheHostsContributionsLazilyAndCopiesEachResultOutOnce) {
  for (uint32_t hosts = 1; hosts <= 4; ++hosts) {
    for (uint32_t local = 2; local <= 3; ++local) {
      for (size_t count : {0, 1, 3, 1000, 100003}) {
        auto links = ConnectRing(hosts, 1 + static_cast<int>((hosts + count) % 3));
        std::vector<std::vector<std::vector<float>>> buffers(hosts, std::vector<std::vector<float>>(local));
        std::vector<float> expected(count, 0.0f);
        for (uint32_t h = 0; h < hosts; ++h) {
          for (uint32_t l = 0; l < local; ++l) {
            for (size_t i = 0; i < count; ++i) {
              buffers[h][l].push_back(static_cast<float>(static_cast<int>((i * 7 + h * 13 + l * 31) % 101) - 50));
              expected[i] += buffers[h][l].back();
            }
          }
        }
        for (auto& e : expected) e *= 0.5f;
        std::vector<std::unique_ptr<CountingHost>> shares;
        for (uint32_t h = 0; h < hosts; ++h) shares.emplace_back(new CountingHost(buffers[h], h % local));
        RunRanks(hosts, [&](uint32_t h) {
          CollectiveDesc desc;
          desc.total_bytes = desc.shard_bytes = count * sizeof(float);
          desc.dtype = static_cast<uint16_t>(DType::kFloat32);
          RingOptions o;
          static_cast<LaneOptions&>(o) = Options(h, hosts);
          o.segment_bytes = 4096;
          ShardWork work{buffers[h][h % local].data(), count, DType::kFloat32, 1.0, 0.5};
          work.host = shares[h].get();
          RingStats stats;
          Status st = RingAllreduce(links[h], desc, work, o, &stats);
          CHECK(st.ok());
          if (!st.ok()) std::fprintf(stderr, "    host %u: %s\n", h, st.message().c_str());
        });
        for (uint32_t h = 0; h < hosts; ++h) {
          CHECK(shares[h]->EachElementOnce());
          for (uint32_t l = 0; l < local; ++l) CHECK(buffers[h][l] == expected);
        }
      }
    }
  }
}

TEST(RingRefusesToShareAHostsContributionsOfAGatherOrAPrescaledInput) {
  auto links = ConnectRing(1, 1);
  std::vector<std::vector<float>> buffers(2, std::vector<float>(8, 1.0f));
  CountingHost share(buffers, 0);
  for (bool gather : {true, false}) {
    CollectiveDesc desc;
    desc.total_bytes = desc.shard_bytes = 8 * sizeof(float);
    desc.dtype = static_cast<uint16_t>(DType::kFloat32);
    if (gather) desc.op = static_cast<uint16_t>(ReduceOp::kGather);
    RingOptions o;
    static_cast<LaneOptions&>(o) = Options(0, 1);
    ShardWork work{buffers[0].data(), 8, DType::kFloat32, gather ? 1.0 : 2.0, 1.0};
    work.host = &share;
    RingStats stats;
    Status st = RingAllreduce(links[0], desc, work, o, &stats);
    CHECK_EQ(static_cast<int>(st.code()), static_cast<int>(Code::kInvalidArgument));
  }
  CHECK(buffers[0] == std::vector<float>(8, 1.0f));  // untouched
}

// A frame travels whole on one socket: a chunk of one segment would leave a lane's other sockets
// idle, so chunks are cut into a segment per socket (never below kMinRingSegmentBytes).
TEST(RingCutsEveryChunkIntoASegmentPerSocket) {
  const size_t mib = 1 << 20, f32 = 4;
  // 4 MiB over 6 ranks, 2 sockets: chunks of ~699 KB, one 1 MiB segment each before; now two.
  const size_t count = 4 * mib / f32;
  size_t seg = RingSegmentElements(count, 6, 2, mib, f32);
  CHECK_EQ(SegmentCount(ChunkBegin(count, 6, 1) - ChunkBegin(count, 6, 0), seg), 2u);
  CHECK_EQ(RingSegmentElements(count, 6, 1, mib, f32), mib / f32);       // one socket: as configured
  CHECK_EQ(RingSegmentElements(64 * mib / f32, 4, 2, mib, f32), mib / f32);  // large chunks: as configured
  CHECK_EQ(RingSegmentElements(1000, 4, 4, mib, f32), kMinRingSegmentBytes / f32);  // small: the floor
  CHECK_EQ(RingSegmentElements(count, 6, 2, 4096, f32), 4096 / f32);     // never above the setting
  for (uint32_t size = 2; size <= 6; ++size) {
    for (size_t sockets = 2; sockets <= 8; ++sockets) {
      for (size_t total : {256 * 1024, 3 * 1000 * 1000, 5 * 1024 * 1024}) {
        const size_t elems = RingSegmentElements(total, size, sockets, mib, 1);
        const size_t chunk = (total + size - 1) / size;
        CHECK(SegmentCount(chunk, elems) >= std::min(sockets, (chunk + kMinRingSegmentBytes - 1) / kMinRingSegmentBytes));
      }
    }
  }
}

TEST(Float16ConversionsOfWholeArraysGiveTheBitsOfTheOneElementConversions) {
  // Whole arrays take the hardware path where the CPU has one (reduce.cc); one element at a time,
  // the software conversion. Every float16, inf and NaN included, and floats around every
  // rounding boundary, the overflow and the subnormal range, and random bit patterns.
  std::vector<uint16_t> halves(65536);
  for (uint32_t h = 0; h < 65536; ++h) halves[h] = static_cast<uint16_t>(h);
  std::vector<float> floats(halves.size());
  FromWire(DType::kFloat16, floats.data(), halves.data(), halves.size());
  for (uint32_t h = 0; h < 65536; ++h) {
    float one;
    FromWire(DType::kFloat16, &one, &halves[h], 1);
    CHECK(std::memcmp(&one, &floats[h], 4) == 0);
  }
  std::vector<float> inputs;
  uint64_t state = 12345;
  for (uint32_t h = 0; h < 65536; ++h) {
    uint32_t bits;
    std::memcpy(&bits, &floats[h], 4);
    for (int32_t delta : {-4097, -4096, -4095, -1, 0, 1, 4095, 4096, 4097}) {
      uint32_t near = bits + static_cast<uint32_t>(delta);
      float f;
      std::memcpy(&f, &near, 4);
      inputs.push_back(f);
    }
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    uint32_t random = static_cast<uint32_t>(state >> 32);
    float f;
    std::memcpy(&f, &random, 4);
    inputs.push_back(f);
  }
  std::vector<uint16_t> whole(inputs.size());
  ToWire(DType::kFloat16, whole.data(), inputs.data(), inputs.size());
  size_t differ = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    uint16_t one;
    ToWire(DType::kFloat16, &one, &inputs[i], 1);
    differ += one != whole[i];
  }
  CHECK(differ == 0);
  std::vector<float> sums(floats.size(), 1.5f), expected(floats.size());
  for (size_t i = 0; i < floats.size(); ++i) expected[i] = 1.5f + floats[i];
  AddFromWire(DType::kFloat16, sums.data(), halves.data(), halves.size());
  CHECK(std::memcmp(sums.data(), expected.data(), 4 * sums.size()) == 0);
}
