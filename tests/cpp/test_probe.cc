// The path probe (transport/probe.h) over loopback: its doubling schedule, its knee rule, and that
// a vanished peer fails the probe instead of hanging (purposes: test_handshake.cc).
#include <cmath>

#include "loopback.h"
#include "transport/probe.h"

using namespace fasthorovod;
using fhtest::ConnectRing;
using fhtest::RunRanks;

namespace {

ProbeOptions Quick(int max_flows, double min_gain) {
  ProbeOptions o;
  o.max_flows = max_flows;
  o.warmup_seconds = 0.01;
  o.measure_seconds = 0.03;
  o.min_gain = min_gain;
  return o;
}

}  // namespace

TEST(ProbeMeasuresEachFlowCountOfTheDoubling) {
  const uint32_t size = 3;
  auto links = ConnectRing(size, 4);
  std::vector<std::vector<ProbePhase>> phases(size);
  std::vector<Status> results(size);
  RunRanks(size, [&](uint32_t r) {
    results[r] = ProbePath(links[r], Quick(4, 0.0), Deadline::After(10.0), &phases[r]);  // gain 0: never stop early
  });
  for (uint32_t r = 0; r < size; ++r) {
    CHECK(results[r].ok());
    CHECK_EQ(phases[r].size(), size_t{3});
    for (size_t i = 0; i < phases[r].size(); ++i) {
      const ProbePhase& p = phases[r][i];
      CHECK_EQ(p.flows, 1 << i);
      CHECK_EQ(p.flow_bytes_per_second.size(), static_cast<size_t>(p.flows));
      CHECK(p.seconds >= 0.03);
      double sum = 0;
      for (double rate : p.flow_bytes_per_second) {
        CHECK(rate > 0);  // every flow of the phase carried bytes
        sum += rate;
      }
      CHECK(std::abs(sum - p.bytes_per_second) <= 1e-6 * sum);
    }
  }
}

TEST(ProbeStopsAtTheKnee) {
  auto links = ConnectRing(2, 8);
  std::vector<std::vector<ProbePhase>> phases(2);
  std::vector<Status> results(2);
  // No doubling can raise the aggregate a million-fold: the probe stops after the first doubling.
  // (Phases of 0.2 s: a 30 ms phase on a loaded machine can move almost nothing, which once made a
  // 100-fold gain look possible.)
  ProbeOptions options = Quick(8, 1e6);
  options.measure_seconds = 0.2;
  RunRanks(2, [&](uint32_t r) { results[r] = ProbePath(links[r], options, Deadline::After(10.0), &phases[r]); });
  for (uint32_t r = 0; r < 2; ++r) {
    CHECK(results[r].ok());
    CHECK_EQ(phases[r].size(), size_t{2});
    CHECK_EQ(phases[r].back().flows, 2);
  }
}

TEST(ProbeFailsPromptlyWhenThePeerVanishes) {
  auto links = ConnectRing(2, 2);
  links[1].to_next.clear();  // rank 1 is gone: its sockets close
  links[1].from_prev.clear();
  std::vector<ProbePhase> phases;
  const int64_t start = NowNs();
  Status st = ProbePath(links[0], Quick(2, 0.0), Deadline::After(10.0), &phases);
  CHECK(!st.ok());
  CHECK(st.code() == Code::kIoError);
  CHECK(st.message().find("probe") != std::string::npos);
  CHECK(NowNs() - start < 5'000'000'000);
}

TEST(ProbeCanStartItsDoublingAboveOneFlow) {
  // A second probe measures only the disputed flow counts: from min_flows up.
  auto links = ConnectRing(2, 8);
  std::vector<std::vector<ProbePhase>> phases(2);
  std::vector<Status> results(2);
  ProbeOptions options = Quick(8, 0.0);
  options.min_flows = 2;
  RunRanks(2, [&](uint32_t r) { results[r] = ProbePath(links[r], options, Deadline::After(10.0), &phases[r]); });
  for (uint32_t r = 0; r < 2; ++r) {
    CHECK(results[r].ok());
    CHECK_EQ(phases[r].size(), size_t{3});
    CHECK_EQ(phases[r][0].flows, 2);
    CHECK_EQ(phases[r][1].flows, 4);
    CHECK_EQ(phases[r][2].flows, 8);
    CHECK_EQ(phases[r][0].flow_bytes_per_second.size(), size_t{2});
  }
}

TEST(ProbeRejectsAFirstFlowCountItHasNoSocketsFor) {
  auto links = ConnectRing(2, 2);
  std::vector<std::vector<ProbePhase>> phases(2);
  std::vector<Status> results(2);
  ProbeOptions options = Quick(2, 0.0);
  options.min_flows = 4;
  const int64_t start = NowNs();
  RunRanks(2, [&](uint32_t r) { results[r] = ProbePath(links[r], options, Deadline::After(10.0), &phases[r]); });
  for (uint32_t r = 0; r < 2; ++r) {
    CHECK(!results[r].ok());
  }
  // at least one side names the bad option (its peer may only see the probe abandoned)
  CHECK(results[0].code() == Code::kInvalidArgument || results[1].code() == Code::kInvalidArgument);
  CHECK((results[0].message() + results[1].message()).find("min_flows") != std::string::npos);
  CHECK(NowNs() - start < 5'000'000'000);
}
