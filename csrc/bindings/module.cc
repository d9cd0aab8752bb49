// fasthorovod._C: the only file that sees pybind11. Tensors cross as Python buffers and raw
// offsets into shared memory; nothing here knows about torch. Every blocking call releases the
// GIL, and every failed Status becomes the exception of its kind (bindings/errors.h). Settings and
// requests cross as bound structs (ChannelConfig, Request), and the codes Python needs (dtypes,
// ops, request kinds, error kinds, limits) are exported from here rather than spelled twice.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstring>

#include "bindings/errors.h"
#include "collectives/reduce.h"
#include "collectives/alltoall.h"
#include "collectives/ring.h"
#include "negotiation/coordinator.h"
#include "negotiation/member.h"
#include "proxy/client.h"
#include "proxy/proxy.h"
#include "shm/segment.h"
#include "transport/probe.h"
#include "transport/socket.h"

namespace py = pybind11;
using namespace fasthorovod;

void RegisterQuantize(pybind11::module_& m);  // bindings/quantize.cc
void RegisterTrace(pybind11::module_& m);     // bindings/trace.cc

namespace {

struct PyCoordinator {
  std::unique_ptr<Coordinator> impl;
  int port = 0;
};

struct PyMember {
  std::unique_ptr<Member> impl;
};

// The worker's end of the path probe (transport/probe.h): listens at construction, so that its
// ports can be exchanged (kProbePorts of them: its flows spread over server ports as a ring's
// lanes' do), and measures once every rank calls run().
class PyPathProbe {
 public:
  PyPathProbe(const std::string& bind_host, const std::string& token, uint32_t rank, uint32_t size,
              uint64_t config_hash) {
    if (token.size() != kTokenBytes) ThrowInvalidArgument(Str("the job token must be ", kTokenBytes, " bytes"));
    std::memcpy(self_.token, token.data(), kTokenBytes);
    self_.rank = rank;
    self_.size = size;
    self_.config_hash = config_hash;
    listeners_.resize(kProbePorts);
    for (Socket& listener : listeners_) {
      int port = 0;
      Check(Listen(bind_host, 0, &listener, &port));
      ports_.push_back(port);
    }
  }
  const std::vector<int>& ports() const { return ports_; }
  void SetPlace(uint32_t rank, uint32_t size) {
    self_.rank = rank;
    self_.size = size;
  }

  std::vector<ProbePhase> Run(const std::string& next_host, const std::vector<int>& next_ports,
                              const ProbeOptions& options, double timeout_seconds) {
    if (options.max_flows < 1 || options.max_flows > static_cast<int>(kMaxSocketsPerLane) * 4) {
      ThrowInvalidArgument(Str("max_flows must be in [1, ", kMaxSocketsPerLane * 4, "], got ", options.max_flows));
    }
    if (options.min_flows < 1 || options.min_flows > options.max_flows) {
      ThrowInvalidArgument(Str("min_flows must be in [1, max_flows = ", options.max_flows, "], got ", options.min_flows));
    }
    if (next_ports.empty() || next_ports.size() > static_cast<size_t>(kProbePorts)) {
      ThrowInvalidArgument(Str("next_ports: the next rank's probe listens on 1 to ", kProbePorts, " ports, got ",
                               next_ports.size()));
    }
    std::vector<ProbePhase> phases;
    CallReleased([&] {
      const Deadline deadline = Deadline::After(timeout_seconds);
      RingLinks links;
      FHVD_RETURN_IF_ERROR(EstablishRing(self_, RingListeners(listeners_), {next_host, next_ports}, options.max_flows,
                                         0, deadline, &links, LinkPurpose::kProbe));
      for (Socket& listener : listeners_) listener.Close();
      return ProbePath(links, options, deadline, &phases);
    });
    return phases;
  }

 private:
  LinkIdentity self_;
  std::vector<Socket> listeners_;
  std::vector<int> ports_;
};

// A shared-memory segment created by the worker (an anonymous memfd, shm/segment.h), exposed as
// a writable Python buffer. The mapping lives as long as this object and any view of it.
class PyShmBuffer {
 public:
  explicit PyShmBuffer(size_t nbytes) {
    Check(ShmSegment::Create(nbytes, Str("a ", HumanBytes(nbytes), " buffer"), &seg_));
    seg_.CloseFd();  // never handed to anyone: the mapping is all it needs
  }
  explicit PyShmBuffer(ShmSegment&& seg) : seg_(std::move(seg)) {}
  size_t nbytes() const { return seg_.size(); }
  ShmSegment& segment() { return seg_; }

 private:
  ShmSegment seg_;
};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "FastHorovod's native core: proxy data plane, shared memory, ring collectives.";

  m.def("run_proxy",
        [](int fd, uint32_t lane) {
          CallReleased([&] { return RunProxy(fd, lane); });
        },
        py::arg("fd"), py::arg("lane"),
        R"pbdoc(Runs a proxy's loop for `lane` until stopped; `fd` is its end of the worker's socket pair.)pbdoc");

  py::class_<PyShmBuffer>(m, "ShmBuffer", py::buffer_protocol(),
                          R"pbdoc(An anonymous shared-memory segment (memfd) of this process, as a writable buffer;
its pages are reserved at creation (a shortage raises here, never a SIGBUS later).)pbdoc")
      .def(py::init<size_t>(), py::arg("nbytes"))
      .def_property_readonly("nbytes", &PyShmBuffer::nbytes)
      .def_buffer([](PyShmBuffer& b) -> py::buffer_info {
        return py::buffer_info(b.segment().data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.segment().size())}, {1});
      });

  py::class_<ChannelConfig>(m, "ChannelConfig", R"pbdoc(The settings a worker gives its proxies (csrc/proxy/client.h).)pbdoc")
      .def(py::init<>())
      .def_readwrite("num_lanes", &ChannelConfig::num_lanes)
      .def_readwrite("rank", &ChannelConfig::rank)
      .def_readwrite("size", &ChannelConfig::size)
      .def_readwrite("socket_buffer_bytes", &ChannelConfig::socket_buffer_bytes)
      .def_readwrite("segment_bytes", &ChannelConfig::segment_bytes)
      .def_readwrite("timeout_seconds", &ChannelConfig::timeout_seconds)
      .def_readwrite("config_hash", &ChannelConfig::config_hash)
      .def_property(
          "token", [](const ChannelConfig& c) { return py::bytes(c.token); },
          [](ChannelConfig& c, const py::bytes& token) { c.token = token; })
      .def_readwrite("bind_host", &ChannelConfig::bind_host);

  py::class_<ProbeOptions>(m, "ProbeOptions", R"pbdoc(The path probe's schedule (csrc/transport/probe.h).)pbdoc")
      .def(py::init<>())
      .def_readwrite("min_flows", &ProbeOptions::min_flows)
      .def_readwrite("max_flows", &ProbeOptions::max_flows)
      .def_readwrite("warmup_seconds", &ProbeOptions::warmup_seconds)
      .def_readwrite("measure_seconds", &ProbeOptions::measure_seconds)
      .def_readwrite("min_gain", &ProbeOptions::min_gain);

  py::class_<PyPathProbe>(m, "PathProbe",
                          R"pbdoc(Measures the goodput of 1, 2, 4, ... parallel TCP flows from the previous rank
(csrc/transport/probe.h). Listens when constructed; run() connects to the next rank's probe and
returns the incoming hop's phases as dicts {flows, seconds, bytes_per_second, flow_bytes_per_second}.)pbdoc")
      .def(py::init<const std::string&, const std::string&, uint32_t, uint32_t, uint64_t>(), py::arg("bind_host"),
           py::arg("token"), py::arg("rank"), py::arg("size"), py::arg("config_hash"))
      .def_property_readonly("ports", &PyPathProbe::ports,
                             R"pbdoc(The ports it listens on (kProbePorts of them); run() on the previous rank connects to these.)pbdoc")
      .def("set_place", &PyPathProbe::SetPlace, py::arg("rank"), py::arg("size"),
           R"pbdoc(Before run(): this probe's place in the ring it measures (another ring than the ranks', e.g. across hosts).)pbdoc")
      .def("run",
           [](PyPathProbe& p, const std::string& next_host, const std::vector<int>& next_ports,
              const ProbeOptions& options, double timeout) {
             py::list out;
             for (const ProbePhase& phase : p.Run(next_host, next_ports, options, timeout)) {
               py::dict d;
               d["flows"] = phase.flows;
               d["seconds"] = phase.seconds;
               d["bytes_per_second"] = phase.bytes_per_second;
               d["flow_bytes_per_second"] = phase.flow_bytes_per_second;
               out.append(d);
             }
             return out;
           },
           py::arg("next_host"), py::arg("next_ports"), py::arg("options"), py::arg("timeout"),
           R"pbdoc(Probes: connects options.max_flows sockets to the next rank's probe at `next_host`, socket s to
next_ports[s % len(next_ports)], accepts as many from the previous rank, and measures the incoming hop.)pbdoc");

  py::class_<RequestDesc>(m, "Request", R"pbdoc(One request to the proxies, as its shared-memory slot holds it (csrc/shm/channel.h).)pbdoc")
      .def(py::init<>())
      .def_readwrite("kind", &RequestDesc::kind)
      .def_readwrite("dtype", &RequestDesc::dtype)
      .def_readwrite("op", &RequestDesc::op)
      .def_readwrite("buffer_id", &RequestDesc::buffer_id)
      .def_readonly("seq", &RequestDesc::seq)
      .def_readwrite("flags", &RequestDesc::flags)
      .def_readwrite("trace_id", &RequestDesc::trace_id)
      .def_readwrite("name_hash", &RequestDesc::name_hash)
      .def_readwrite("shape_hash", &RequestDesc::shape_hash)
      .def_readwrite("count", &RequestDesc::count)
      .def_readwrite("buffer_offset", &RequestDesc::buffer_offset)
      .def_readwrite("prescale", &RequestDesc::prescale)
      .def_readwrite("postscale", &RequestDesc::postscale)
      .def_property(
          "name", [](const RequestDesc& r) { return std::string(r.name, strnlen(r.name, kNameBytes)); },
          [](RequestDesc& r, const std::string& name) { CopyString(r.name, name); })
      .def_property(
          "lane_begin",
          [](const RequestDesc& r) {
            return std::vector<uint64_t>(r.lane_begin, r.lane_begin + (r.num_lanes ? r.num_lanes + 1 : 0));
          },
          [](RequestDesc& r, const std::vector<uint64_t>& bounds) {
            if (bounds.size() < 2 || bounds.size() > kMaxLanes + 1) {
              ThrowInvalidArgument(Str("lane_begin needs 2 to ", kMaxLanes + 1, " boundaries, got ", bounds.size()));
            }
            std::copy(bounds.begin(), bounds.end(), r.lane_begin);
            r.num_lanes = static_cast<uint32_t>(bounds.size() - 1);
          },
          R"pbdoc(Element boundaries of the lanes' shards: num_lanes + 1 entries from 0 to count.)pbdoc");

  py::class_<ProxyChannel>(m, "ProxyChannel", R"pbdoc(The worker's end of the shared-memory request channel.)pbdoc")
      .def(py::init([](const ChannelConfig& config) {
             std::unique_ptr<ProxyChannel> channel;
             Check(ProxyChannel::Create(config, &channel));
             return channel;
           }),
           py::arg("config"))
      .def_property_readonly("num_lanes", &ProxyChannel::num_lanes)
      .def("proxy_fd", &ProxyChannel::ProxyFd, py::arg("lane"),
           R"pbdoc(The descriptor lane's proxy must inherit (its end of the socket pair); -1 once handed over.)pbdoc")
      .def("watch_proxy", [](ProxyChannel& c, uint32_t lane, int pid) { Check(c.WatchProxy(lane, pid)); },
           py::arg("lane"), py::arg("pid"),
           R"pbdoc(Registers lane's spawned proxy: closes this process's copy of its descriptor and reaps it when it exits.)pbdoc")
      .def_property_readonly("uses_pidfds", &ProxyChannel::UsesPidfds)
      .def("create_buffer",
           [](ProxyChannel& c, uint32_t id, size_t nbytes) {
             ShmSegment seg;
             CallReleased([&] { return c.CreateBuffer(id, nbytes, &seg); });
             return std::make_unique<PyShmBuffer>(std::move(seg));
           },
           py::arg("id"), py::arg("nbytes"),
           R"pbdoc(A zero-filled ShmBuffer every proxy knows as buffer `id`.)pbdoc")
      .def("create_host",
           [](ProxyChannel& c, uint32_t local_size) {
             int fd = -1;
             Check(c.CreateHost(local_size, &fd));
             return fd;
           },
           py::arg("local_size"),
           R"pbdoc(Local rank 0: creates the host segment of the hierarchical allreduce; returns its descriptor (the others open /proc/<pid>/fd/<fd>).)pbdoc")
      .def("open_host", [](ProxyChannel& c, int pid, int fd, uint32_t local_size) { Check(c.OpenHost(pid, fd, local_size)); },
           py::arg("pid"), py::arg("fd"), py::arg("local_size"),
           R"pbdoc(The other local ranks: opens local rank 0's host segment (its pid and descriptor) and checks it is this job's.)pbdoc")
      .def("attach_host",
           [](ProxyChannel& c, uint32_t local_rank, uint32_t host_index, uint32_t num_hosts) {
             CallReleased([&] { return c.AttachHost(local_rank, host_index, num_hosts); });
           },
           py::arg("local_rank"), py::arg("host_index"), py::arg("num_hosts"),
           R"pbdoc(Before connect: the proxies run the hierarchical allreduce as this local rank of host `host_index` of `num_hosts`.)pbdoc")
      .def_property_readonly("hierarchical", &ProxyChannel::hierarchical)
      .def("wait_listening",
           [](ProxyChannel& c, double timeout) {
             std::vector<std::vector<int>> ports;
             CallReleased([&] { return c.WaitListening(timeout, &ports); });
             return ports;
           },
           R"pbdoc(Waits until every lane's proxy listens; each lane's ring ports [port, alt_port].)pbdoc")
      .def("mesh_ports", &ProxyChannel::MeshPorts,
           R"pbdoc(After wait_listening: each lane's mesh port for the alltoall (0: no mesh).)pbdoc")
      .def("connect",
           [](ProxyChannel& c, const std::vector<std::string>& hosts, const std::vector<std::vector<int>>& ports,
              uint32_t sockets_per_lane, double timeout, const std::vector<std::string>& mesh_hosts,
              const std::vector<std::vector<int>>& mesh_ports) {
             CallReleased([&] { return c.Connect(hosts, ports, sockets_per_lane, timeout, mesh_hosts, mesh_ports); });
           },
           py::arg("hosts"), py::arg("ports"), py::arg("sockets_per_lane"), py::arg("timeout"),
           py::arg("mesh_hosts") = std::vector<std::string>{}, py::arg("mesh_ports") = std::vector<std::vector<int>>{},
           R"pbdoc(Lets the proxies connect lane j to hosts[j] at ports[j] (its one or two ring ports, as wait_listening returned them there) with `sockets_per_lane` sockets each way; `mesh_hosts[r]` and `mesh_ports[r][j]` are where lane j's alltoall mesh finds rank r.)pbdoc")
      .def("post",
           [](ProxyChannel& c, const RequestDesc& request) {
             uint64_t seq = 0;
             CallReleased([&] { return c.Post(request, &seq); });
             return seq;
           },
           py::arg("request"), R"pbdoc(Posts a Request and returns its sequence number.)pbdoc")
      .def("poll", &ProxyChannel::Poll)
      .def("wait",
           [](ProxyChannel& c, uint64_t seq, double timeout) {
             CallReleased([&] { return c.Wait(seq, timeout); });
           })
      .def("set_trace",
           [](ProxyChannel& c, const std::string& dir, int64_t clock_offset_ns, double timeout) {
             CallReleased([&] { return c.SetTrace(dir, clock_offset_ns, timeout); });
           },
           py::arg("dir"), py::arg("clock_offset_ns"), py::arg("timeout"),
           R"pbdoc(Starts (dir) or stops ("") the proxies' traces; a stop waits for every live lane.)pbdoc")
      .def("stop", &ProxyChannel::Stop)
      .def("abort", &ProxyChannel::Abort)
      .def("in_flight", &ProxyChannel::InFlight, R"pbdoc(Whether a posted request has not completed.)pbdoc")
      .def("terminate",
           [](ProxyChannel& c, double grace) {
             py::gil_scoped_release release;
             c.Terminate(grace);
           },
           py::arg("grace_seconds"),
           R"pbdoc(Waits up to grace_seconds for the proxies to exit, kills the rest, reaps them all.)pbdoc")
      .def("exit_code",
           [](const ProxyChannel& c, uint32_t lane) -> py::object {
             int code = 0;
             if (!c.ExitCode(lane, &code)) return py::none();
             return py::int_(code);
           },
           py::arg("lane"), R"pbdoc(The lane's proxy's exit code as Popen has it (-signal), or None while it runs.)pbdoc")
      .def(
          "lane_progress",
          [](const ProxyChannel& c) {
            py::tuple out(c.num_lanes());
            for (uint32_t lane = 0; lane < c.num_lanes(); ++lane) {
              uint64_t bytes_sent = 0, busy_ns = 0;
              c.LaneProgress(lane, &bytes_sent, &busy_ns);
              out[lane] = py::make_tuple(bytes_sent, busy_ns);
            }
            return out;
          },
          R"pbdoc(Per lane, (bytes_sent, busy_ns): the two counters a rebalancing policy reads before each request.)pbdoc")
      .def("lane", [](const ProxyChannel& c, uint32_t lane) {
        LaneSnapshot s = c.Lane(lane);
        py::dict d;
        d["state"] = s.state;
        d["pid"] = s.pid;
        d["port"] = s.port;
        d["alt_port"] = s.alt_port;
        d["error"] = s.error;
        d["error_code"] = CodeName(CodeFromWire(s.error_code));
        d["bytes_sent"] = s.bytes_sent;
        d["bytes_received"] = s.bytes_received;
        d["collectives"] = s.collectives;
        d["zero_filled"] = s.zero_filled;
        d["busy_ns"] = s.busy_ns;
        d["mesh_bytes_sent"] = s.mesh_bytes_sent;
        d["mesh_bytes_received"] = s.mesh_bytes_received;
        d["rehashes"] = s.rehashes;
        d["rehash_ns"] = s.rehash_ns;
        return d;
      })
      .def("socket_progress", &ProxyChannel::SocketProgress, py::arg("lane"),
           R"pbdoc(Per send socket of `lane`: (bytes_sent, backlogged_ns), what a re-hashing policy compares.)pbdoc")
      .def(
          "request_rehash",
          [](ProxyChannel& c, uint32_t lane, uint64_t mask) { Check(c.RequestRehash(lane, mask)); },
          py::arg("lane"), py::arg("mask"),
          R"pbdoc(Asks `lane` to replace the send sockets in `mask` (bit s: socket s) by new connections after its next collective.)pbdoc");

  py::class_<CoordinatorOptions>(m, "CoordinatorOptions", R"pbdoc(Settings of rank 0's coordinator.)pbdoc")
      .def(py::init<>())
      .def_readwrite("size", &CoordinatorOptions::size)
      .def_property(
          "token", [](const CoordinatorOptions& o) { return py::bytes(o.token); },
          [](CoordinatorOptions& o, const py::bytes& token) { o.token = token; })
      .def_readwrite("bind_host", &CoordinatorOptions::bind_host)
      .def_readwrite("timeout_seconds", &CoordinatorOptions::timeout_seconds)
      .def_readwrite("stall_check_seconds", &CoordinatorOptions::stall_check_seconds)
      .def_readwrite("stall_shutdown_seconds", &CoordinatorOptions::stall_shutdown_seconds);

  py::class_<PyCoordinator>(m, "Coordinator", R"pbdoc(Rank 0's negotiation coordinator (csrc/negotiation/coordinator.h).)pbdoc")
      .def(py::init([](const CoordinatorOptions& options) {
             auto c = std::make_unique<PyCoordinator>();
             Check(Coordinator::Start(options, &c->impl, &c->port));
             return c;
           }),
           py::arg("options"))
      .def_readonly("port", &PyCoordinator::port)
      .def("stop", [](PyCoordinator& c) {
        py::gil_scoped_release release;
        c.impl->Stop();
      })
      .def_property_readonly("error", [](const PyCoordinator& c) { return c.impl->error(); });

  py::class_<MemberOptions>(m, "MemberOptions", R"pbdoc(Settings of this rank's negotiation member.)pbdoc")
      .def(py::init<>())
      .def_readwrite("rank", &MemberOptions::rank)
      .def_readwrite("size", &MemberOptions::size)
      .def_property(
          "token", [](const MemberOptions& o) { return py::bytes(o.token); },
          [](MemberOptions& o, const py::bytes& token) { o.token = token; })
      .def_readwrite("coordinator_host", &MemberOptions::coordinator_host)
      .def_readwrite("coordinator_port", &MemberOptions::coordinator_port)
      .def_readwrite("timeout_seconds", &MemberOptions::timeout_seconds);

  py::class_<PyMember>(m, "Member", R"pbdoc(This rank's member of the negotiation (csrc/negotiation/member.h).)pbdoc")
      .def(py::init([](ProxyChannel& channel, const MemberOptions& options) {
             auto p = std::make_unique<PyMember>();
             CallReleased([&] { return Member::Start(&channel, options, &p->impl); });
             return p;
           }),
           py::arg("channel"), py::arg("options"), py::keep_alive<1, 2>())
      .def("number_tickets_from", [](PyMember& m, uint64_t first) { Check(m.impl->NumberTicketsFrom(first)); },
           py::arg("first"),
           R"pbdoc(Numbers this member's tickets from `first` on (only before its first ticket).)pbdoc")
      .def("set_lane_weights",
           [](PyMember& m, const std::vector<double>& weights) { Check(m.impl->SetLaneWeights(weights)); },
           py::arg("weights"),
           R"pbdoc(The lane weights of the collectives this rank submits from now on (sent to the coordinator, which cuts each run order by the lead rank's).)pbdoc")
      .def("submit",
           [](PyMember& m, const RequestDesc& request, const std::string& shape) {
             uint64_t ticket = 0;
             Check(m.impl->Submit(request, shape, &ticket));
             return ticket;
           },
           py::arg("request"), py::arg("shape"),
           R"pbdoc(Submits a Request under its name; returns a ticket for poll/wait. A name in flight (submitted, its ticket not yet waited on) raises FastHorovodValueError with Horovod's message.)pbdoc")
      .def("join",
           [](PyMember& m) {
             uint64_t ticket = 0;
             CallReleased([&] { return m.impl->Join(&ticket); });
             return ticket;
           },
           R"pbdoc(This rank joins; returns once the coordinator has recorded it (GIL released), with a ticket whose wait gives the last rank to join.)pbdoc")
      .def("holds", [](PyMember& m, const std::string& name) { return m.impl->Holds(name); }, py::arg("name"),
           R"pbdoc(Whether `name` is in flight: submitted, its ticket not yet waited on (what submit refuses).)pbdoc")
      .def("poll", [](PyMember& m, uint64_t ticket) { return m.impl->Poll(ticket); })
      .def("check", [](PyMember& m) { Check(m.impl->Broken()); },
           R"pbdoc(Raises why the data plane is broken (a failure on this rank or another), if it is.)pbdoc")
      .def("wait",
           [](PyMember& m, uint64_t ticket, double timeout) {
             int64_t last = -1;
             CallReleased([&] { return m.impl->Wait(ticket, timeout, &last); });
             return last;
           },
           py::arg("ticket"), py::arg("timeout"),
           R"pbdoc(Waits for the ticket (GIL released); returns the last joined rank for a join ticket, else -1.)pbdoc")
      .def("close", [](PyMember& m) {
        py::gil_scoped_release release;
        m.impl->Close();
      });

  // One thread, GIL released from 1 MiB: torch's copy_ and zero_ run on its intra-op pool, whose
  // idle threads spin after every parallel region and take the CPUs the proxies need
  // (docs/dataplane.md, "Staging copies"). The caller passes addresses of memory it keeps alive.
  m.def("copy_bytes",
        [](uintptr_t dst, uintptr_t src, size_t nbytes) {
          RunReleasedIf(nbytes >= (size_t{1} << 20),
                        [&] { std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes); });
        },
        py::arg("dst"), py::arg("src"), py::arg("nbytes"),
        R"pbdoc(Copies nbytes from address src to address dst on the calling thread (memmove).)pbdoc");
  m.def("zero_bytes",
        [](uintptr_t dst, size_t nbytes) {
          RunReleasedIf(nbytes >= (size_t{1} << 20), [&] { std::memset(reinterpret_cast<void*>(dst), 0, nbytes); });
        },
        py::arg("dst"), py::arg("nbytes"), R"pbdoc(Zeroes nbytes at address dst on the calling thread.)pbdoc");
  m.def("shard_boundaries",
        [](uint64_t count, const std::vector<double>& weights) {
          const std::string problem = LaneWeightsProblem(weights, 0);
          if (!problem.empty()) ThrowInvalidArgument("lane weights with " + problem);
          return ShardBoundaries(count, weights);
        },
        py::arg("count"), py::arg("weights"),
        R"pbdoc(Element boundaries of each lane's shard of `count` elements, proportional to `weights` (lane j takes [b_j, b_j+1); 0 first, count last): the coordinator's one computation (csrc/negotiation/wire.h).)pbdoc");
  m.def("alltoall_send_offset", &AlltoallSendOffset, py::arg("size"),
        R"pbdoc(Where an alltoall's send region starts in its buffer, after the size table of `size` ranks (collectives/alltoall.h).)pbdoc");
  m.def("alltoall_staged_word", &AlltoallStagedWord, py::arg("size"),
        R"pbdoc(The index of the staged word in an alltoall's size table of `size` ranks: how many blocks the worker has staged, in distance order (collectives/alltoall.h).)pbdoc");
  m.def("alltoall_claim_word", &AlltoallClaimWord, py::arg("size"),
        R"pbdoc(The index of the first of the `size` claim words in an alltoall's size table (segments of each rank's block the lanes have claimed; zero when submitted: collectives/alltoall.h).)pbdoc");
  m.attr("ALLTOALL_STAGING_FAILED") = kAlltoallStagingFailed;
  m.def("publish_word",
        [](uintptr_t address, uint64_t value) {
          std::atomic_thread_fence(std::memory_order_seq_cst);  // after every store before it, streaming ones too
          __atomic_store_n(reinterpret_cast<uint64_t*>(address), value, __ATOMIC_RELEASE);
        },
        py::arg("address"), py::arg("value"),
        R"pbdoc(Stores the 64-bit `value` at `address` (8-byte aligned, in shared memory) after every store this thread made before it: another process that reads the value with an acquire load sees them.)pbdoc");
  m.def("allgather_own_chunk", &AllgatherOwnChunk, py::arg("rank"), py::arg("size"),
        R"pbdoc(The ring chunk that holds a rank's own contribution to an allgather (OP_GATHER).)pbdoc");
  m.attr("MAX_LANES") = kMaxLanes;
  m.attr("NUM_SLOTS") = kNumSlots;
  m.attr("OP_SUM") = static_cast<uint32_t>(ReduceOp::kSum);
  m.attr("OP_AVERAGE") = static_cast<uint32_t>(ReduceOp::kAverage);
  m.attr("OP_GATHER") = static_cast<uint32_t>(ReduceOp::kGather);
  m.attr("OP_BROADCAST") = static_cast<uint32_t>(ReduceOp::kBroadcast);
  m.attr("OP_REDUCESCATTER") = static_cast<uint32_t>(ReduceOp::kReduceScatter);
  m.attr("OP_ALLTOALL") = static_cast<uint32_t>(ReduceOp::kAlltoall);
  m.attr("MAX_MESH_RANKS") = kMaxMeshRanks;
  m.attr("REQUEST_ALLREDUCE") = static_cast<uint32_t>(RequestKind::kAllreduce);
  py::dict dtypes;  // torch's names ("float32", ...) -> the core's codes
  py::dict wire;    // (torch's name in memory, on the wire) -> the compressed codes
  for (uint32_t d = 0; d < kNumDTypes; ++d) {
    const DType dtype = static_cast<DType>(d);
    if (WireCompressed(dtype)) {
      wire[py::make_tuple(DTypeName(DType::kFloat32), DTypeName(WireDType(dtype)))] = d;
    } else {
      dtypes[DTypeName(dtype)] = d;
    }
  }
  m.attr("DTYPES") = dtypes;
  m.attr("WIRE_DTYPES") = wire;
  py::dict codes;  // error kinds ("timeout", ...) -> codes; fasthorovod.exceptions maps them to classes
  for (uint32_t c = 1; c < kNumCodes; ++c) codes[CodeName(static_cast<Code>(c))] = c;
  m.attr("ERROR_CODES") = codes;
  RegisterQuantize(m);
  RegisterTrace(m);
}
