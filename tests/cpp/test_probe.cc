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

// Every rank of `links` probes at once with `options`: each rank's phases and status.
struct ProbeRun {
  std::vector<std::vector<ProbePhase>> phases;
  std::vector<Status> results;
};

ProbeRun RunProbe(std::vector<RingLinks>& links, const ProbeOptions& options) {
  const uint32_t size = static_cast<uint32_t>(links.size());
  ProbeRun run{std::vector<std::vector<ProbePhase>>(size), std::vector<Status>(size)};
  RunRanks(size, [&](uint32_t r) { run.results[r] = ProbePath(links[r], options, Deadline::After(10.0), &run.phases[r]); });
  return run;
}

// Every rank's probe succeeded and measured exactly the flow counts `flows`, in order.
void CheckPhases(const ProbeRun& run, const std::vector<int>& flows) {
  for (size_t r = 0; r < run.results.size(); ++r) {
    CHECK(run.results[r].ok());
    CHECK_EQ(run.phases[r].size(), flows.size());
    for (size_t i = 0; i < flows.size() && i < run.phases[r].size(); ++i) {
      CHECK_EQ(run.phases[r][i].flows, flows[i]);
      CHECK_EQ(run.phases[r][i].flow_bytes_per_second.size(), static_cast<size_t>(flows[i]));
    }
  }
}

}  // namespace

TEST(ProbeMeasuresEachFlowCountOfTheDoubling) {
  const uint32_t size = 3;
  auto links = ConnectRing(size, 4);
  const ProbeRun run = RunProbe(links, Quick(4, 0.0));  // gain 0: never stop early
  CheckPhases(run, {1, 2, 4});
  for (uint32_t r = 0; r < size; ++r) {
    for (const ProbePhase& p : run.phases[r]) {
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
  // No doubling can raise the aggregate a million-fold: the probe stops after the second doubling
  // (two flat doublings in a row; one could be two flows on one per-flow cap). (Phases of 0.2 s: a
  // 30 ms phase on a loaded machine can move almost nothing, which once made a 100-fold gain look
  // possible.)
  ProbeOptions options = Quick(8, 1e6);
  options.measure_seconds = 0.2;
  CheckPhases(RunProbe(links, options), {1, 2, 4});
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
  ProbeOptions options = Quick(8, 0.0);
  options.min_flows = 2;
  CheckPhases(RunProbe(links, options), {2, 4, 8});
}

TEST(ProbeRejectsAFirstFlowCountItHasNoSocketsFor) {
  auto links = ConnectRing(2, 2);
  ProbeOptions options = Quick(2, 0.0);
  options.min_flows = 4;
  const int64_t start = NowNs();
  const ProbeRun run = RunProbe(links, options);
  CHECK(!run.results[0].ok() && !run.results[1].ok());
  // at least one side names the bad option (its peer may only see the probe abandoned)
  CHECK(run.results[0].code() == Code::kInvalidArgument || run.results[1].code() == Code::kInvalidArgument);
  CHECK((run.results[0].message() + run.results[1].message()).find("min_flows") != std::string::npos);
  CHECK(NowNs() - start < 5'000'000'000);
}
