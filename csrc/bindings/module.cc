// fasthorovod._C: the only file that sees pybind11. Tensors cross as Python buffers and raw
// offsets into shared memory; nothing here knows about torch. Every blocking call releases the
// GIL, and every failed Status becomes one exception of the fasthorovod.exceptions family.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>

#include "bindings/errors.h"
#include "collectives/reduce.h"
#include "collectives/ring.h"
#include "proxy/client.h"
#include "proxy/proxy.h"
#include "shm/segment.h"
#include "transport/socket.h"

namespace py = pybind11;
using namespace fasthorovod;

void RegisterQuantize(pybind11::module_& m);  // bindings/quantize.cc
void RegisterTrace(pybind11::module_& m);     // bindings/trace.cc

namespace {

// Runs a blocking call without the GIL (so other Python threads, e.g. Horovod's, keep running),
// then raises its error, if any, as the matching FastHorovod exception.
template <typename F>
void CallReleased(F&& call) {
  Status st;
  {
    py::gil_scoped_release release;
    st = call();
  }
  Check(st);
}

// A shared-memory segment created by the worker, exposed as a writable Python buffer.
class PyShmBuffer {
 public:
  PyShmBuffer(const std::string& name, size_t nbytes) { Check(ShmSegment::Create(name, nbytes, &seg_)); }
  std::string name() const { return seg_.name(); }
  size_t nbytes() const { return seg_.size(); }
  bool linked() const { return seg_.linked(); }
  void unlink() { seg_.Unlink(); }
  void close() {
    seg_.Unlink();
    seg_.Unmap();
  }
  ShmSegment& segment() { return seg_; }

 private:
  ShmSegment seg_;
};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "FastHorovod's native core: proxy data plane, shared memory, ring collectives.";

  m.def("run_proxy",
        [](const std::string& channel, uint32_t lane) {
          CallReleased([&] { return RunProxy(channel, lane); });
        },
        py::arg("channel"), py::arg("lane"),
        R"pbdoc(Runs a proxy's loop for `lane` of the worker's `channel` until stopped.)pbdoc");

  py::class_<PyShmBuffer>(m, "ShmBuffer", py::buffer_protocol(),
                          R"pbdoc(A shared-memory segment created by this process, as a writable buffer.)pbdoc")
      .def(py::init<const std::string&, size_t>(), py::arg("name"), py::arg("nbytes"))
      .def_property_readonly("name", &PyShmBuffer::name)
      .def_property_readonly("nbytes", &PyShmBuffer::nbytes)
      .def_property_readonly("linked", &PyShmBuffer::linked)
      .def("unlink", &PyShmBuffer::unlink, R"pbdoc(Removes the name from /dev/shm; the mapping stays.)pbdoc")
      .def("close", &PyShmBuffer::close, R"pbdoc(Unlinks and unmaps. No view may be used afterwards.)pbdoc")
      .def_buffer([](PyShmBuffer& b) -> py::buffer_info {
        return py::buffer_info(b.segment().data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.segment().size())}, {1});
      });

  py::class_<ProxyChannel>(m, "ProxyChannel", R"pbdoc(The worker's end of the shared-memory request channel.)pbdoc")
      .def(py::init([](const std::string& name, uint32_t num_lanes, uint32_t rank, uint32_t size,
                       uint32_t sockets_per_lane, int32_t socket_buffer_bytes, uint64_t segment_bytes,
                       double timeout_seconds, uint64_t config_hash, py::bytes token, const std::string& bind_host,
                       const std::string& buffer_prefix) {
             ChannelConfig config;
             config.num_lanes = num_lanes;
             config.rank = rank;
             config.size = size;
             config.sockets_per_lane = sockets_per_lane;
             config.socket_buffer_bytes = socket_buffer_bytes;
             config.segment_bytes = segment_bytes;
             config.timeout_seconds = timeout_seconds;
             config.config_hash = config_hash;
             config.token = token;
             config.bind_host = bind_host;
             config.buffer_prefix = buffer_prefix;
             std::unique_ptr<ProxyChannel> channel;
             Check(ProxyChannel::Create(name, config, &channel));
             return channel;
           }),
           py::arg("name"), py::arg("num_lanes"), py::arg("rank"), py::arg("size"), py::arg("sockets_per_lane"),
           py::arg("socket_buffer_bytes"), py::arg("segment_bytes"), py::arg("timeout_seconds"),
           py::arg("config_hash"), py::arg("token"), py::arg("bind_host"), py::arg("buffer_prefix"))
      .def_property_readonly("name", &ProxyChannel::name)
      .def_property_readonly("num_lanes", &ProxyChannel::num_lanes)
      .def("watch_proxy", [](ProxyChannel& c, uint32_t lane, int pid) { Check(c.WatchProxy(lane, pid)); })
      .def("wait_listening",
           [](ProxyChannel& c, double timeout) {
             std::vector<int> ports;
             CallReleased([&] { return c.WaitListening(timeout, &ports); });
             return ports;
           })
      .def("connect",
           [](ProxyChannel& c, const std::vector<std::string>& hosts, const std::vector<int>& ports, double timeout) {
             CallReleased([&] { return c.Connect(hosts, ports, timeout); });
           })
      .def("unlink_name", &ProxyChannel::UnlinkName)
      .def("post",
           [](ProxyChannel& c, uint32_t buffer_id, uint64_t buffer_offset, uint64_t count, uint32_t dtype, uint32_t op,
              double prescale, double postscale, uint64_t name_hash, uint64_t shape_hash, const std::string& name,
              const std::vector<uint64_t>& lane_begin, uint32_t kind) {
             AllreduceRequest r;
             r.kind = kind;
             r.buffer_id = buffer_id;
             r.buffer_offset = buffer_offset;
             r.count = count;
             r.dtype = dtype;
             r.op = op;
             r.prescale = prescale;
             r.postscale = postscale;
             r.name_hash = name_hash;
             r.shape_hash = shape_hash;
             r.name = name;
             r.lane_begin = lane_begin;
             uint64_t seq = 0;
             CallReleased([&] { return c.Post(r, &seq); });
             return seq;
           },
           py::arg("buffer_id"), py::arg("buffer_offset"), py::arg("count"), py::arg("dtype"), py::arg("op"),
           py::arg("prescale"), py::arg("postscale"), py::arg("name_hash"), py::arg("shape_hash"), py::arg("name"),
           py::arg("lane_begin"), py::arg("kind") = static_cast<uint32_t>(RequestKind::kAllreduce),
           R"pbdoc(Posts a request (an allreduce, or kind 2/3: enter/leave hvd.join) and returns its sequence number.)pbdoc")
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
      .def("lane", [](const ProxyChannel& c, uint32_t lane) {
        LaneSnapshot s = c.Lane(lane);
        py::dict d;
        d["state"] = s.state;
        d["pid"] = s.pid;
        d["port"] = s.port;
        d["error"] = s.error;
        d["bytes_sent"] = s.bytes_sent;
        d["bytes_received"] = s.bytes_received;
        d["collectives"] = s.collectives;
        d["zero_filled"] = s.zero_filled;
        d["busy_ns"] = s.busy_ns;
        return d;
      });

  m.def("allgather_own_chunk", &AllgatherOwnChunk, py::arg("rank"), py::arg("size"),
        R"pbdoc(The ring chunk that holds a rank's own contribution to an allgather (OP_GATHER).)pbdoc");
  m.attr("MAX_LANES") = kMaxLanes;
  m.attr("REQUEST_JOIN") = static_cast<uint32_t>(RequestKind::kJoin);
  m.attr("OP_SUM") = static_cast<uint32_t>(ReduceOp::kSum);
  m.attr("OP_AVERAGE") = static_cast<uint32_t>(ReduceOp::kAverage);
  m.attr("OP_GATHER") = static_cast<uint32_t>(ReduceOp::kGather);
  m.attr("REQUEST_EXIT_JOIN") = static_cast<uint32_t>(RequestKind::kExitJoin);
  m.attr("NUM_SLOTS") = kNumSlots;
  RegisterQuantize(m);
  RegisterTrace(m);
}
