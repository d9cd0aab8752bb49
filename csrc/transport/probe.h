// The path probe: how much one TCP flow, and how much several parallel flows, carry from the
// previous rank to this one — the measurement the data plane's flow count is chosen from.
//
// Clouds cap each TCP flow (AWS: 5 Gbit/s per flow on 25–100 Gbit/s NICs) and some paths hash
// flows onto shared buckets, so the number of flows a link needs is a property of the network,
// not of the program. At start-up (inside hvd.init(), before the proxies connect) every worker
// opens up to `max_flows` authenticated connections to its next rank (LinkPurpose::kProbe, the
// same handshake as the ring's) and accepts as many from its previous rank; then every hop of the
// ring is measured at once, each by its receiving end:
//
//   receiver (this rank)                        sender (the previous rank)
//   ── Control{flows = 1} on socket 0 ──────►   streams on sockets [0, 1)
//      warm-up, then counts each socket's bytes for `measure_seconds`
//   ── Control{flows = 2} ─────────────────►   streams on sockets [0, 2)
//      ...                                      ...
//   ── Control{flows = 0} ─────────────────►   stops, resets its sockets
//      reads to each socket's end (the reset)
//
// The flow count doubles (1, 2, 4, ..., or from `min_flows`) until it reaches max_flows or two
// doublings in a row add less than `min_gain` each to the aggregate (the knee): one alone can be
// two flows hashed onto one per-flow cap (on a network with few buckets per server port, one hop in
// seven or so), after which more flows still gain, and a hop that stopped there would pass for a
// link of one flow's rate. Controls travel on the receiving sockets' reverse
// direction, so each hop is driven by its own receiver and hops need no clock in common; in a
// ring every host's egress carries only its own hop, so the hops do not disturb each other.
// Bytes still in flight from a phase are counted as they arrive but fall into the next phase's
// warm-up, never into a measurement window. What the sender still holds when told to stop is
// dropped, not delivered: its sockets close with a reset (SO_LINGER 0). Autotuned send buffers
// fill behind a shaped link, and letting them drain to an orderly EOF took 0.08-0.36 s per probe
// on 6:1gbit:200mbit, against 0.01-0.05 s now.
//
// Every wait is bounded by the deadline; on any error both directions are abandoned and the
// caller gets the Status (the job then fails at start-up with the reason).
#pragma once

#include <cstdint>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "transport/socket.h"

namespace fasthorovod {

struct ProbeOptions {
  int min_flows = 1;                // the first phase's flow count (a second probe starts at the disputed knees)
  int max_flows = 16;               // upper end of the doubling (min_flows, 2·min_flows, ... <= max_flows)
  double warmup_seconds = 0.08;     // after a change of flow count, before counting
  double measure_seconds = 0.15;    // counting window per flow count
  double min_gain = 1.05;           // a doubling must raise the aggregate by this factor to go on
};

// The ports a worker's probe listens on. A ring's lane listens on two, and the data plane runs
// up to four lanes by default, so the rings' flows into a rank spread over eight server ports;
// the probe's flows spread alike (flow s to port s % 8 when the sender uses all eight). Sent to
// a single port, they would share one port's hash bits where a network hashes a few bits of each
// port, and collide far more often than the rings' flows will.
constexpr int kProbePorts = 8;

// Doublings in a row that must each gain less than min_gain for the probe to stop.
constexpr int kFlatDoublingsToStop = 2;

// One flow count's measurement of the incoming hop.
struct ProbePhase {
  int flows = 0;
  double seconds = 0.0;                  // the counting window actually used
  double bytes_per_second = 0.0;         // all flows together
  std::vector<double> flow_bytes_per_second;  // each flow
};

// Runs both directions of the probe over `links` (from EstablishRing with LinkPurpose::kProbe and
// options.max_flows sockets each way): streams to the next rank as its receiver asks, and
// measures what arrives from the previous rank into `incoming`.
Status ProbePath(RingLinks& links, const ProbeOptions& options, Deadline deadline, std::vector<ProbePhase>* incoming);

}  // namespace fasthorovod
