// fasthorovod._C: the proxy trace recorder (csrc/trace/recorder.h) for tests and tools.
//
// The data plane uses TraceRecorder from C++ only; these bindings exist so that the file format
// written by the real recorder is exercised from Python: tests write synthetic traces with
// `TraceRecorder.record(...)` (fasthorovod_testing._trace_selftest measures Record() itself).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "bindings/errors.h"
#include "trace/recorder.h"

namespace py = pybind11;
using namespace fasthorovod;

namespace {


class PyTraceRecorder {
 public:
  void Open(const std::string& dir, uint32_t rank, uint32_t lane, int64_t clock_offset_ns, uint32_t size,
            size_t capacity, int flush_interval_ms, const std::string& extra_json) {
    TraceOptions o;
    o.dir = dir;
    o.rank = rank;
    o.lane = lane;
    o.size = size;
    o.clock_offset_ns = clock_offset_ns;
    o.capacity = capacity;
    o.flush_interval_ms = flush_interval_ms;
    o.extra_json = extra_json;
    lane_ = lane;
    Check(recorder_.Open(o));
  }

  int64_t Record(uint32_t src, uint32_t dst, uint8_t direction, uint64_t bytes, int64_t start_ns, int64_t end_ns,
                 uint64_t seq, py::object request, uint64_t name_hash, uint64_t shard_bytes, py::object ready_ns,
                 uint32_t step, uint32_t segment, int lane, uint16_t socket, uint8_t op, uint8_t dep_type,
                 int64_t dep_id, uint8_t flags) {
    MessageRecord r;
    r.src = src;
    r.dst = dst;
    r.direction = direction;
    r.bytes = bytes;
    r.start_ns = start_ns;
    r.end_ns = end_ns;
    r.ready_ns = ready_ns.is_none() ? start_ns : ready_ns.cast<int64_t>();
    r.seq = seq;
    r.request = request.is_none() ? kNoRequest : request.cast<uint64_t>();
    r.name_hash = name_hash;
    r.shard_bytes = shard_bytes;
    r.step = step;
    r.segment = segment;
    r.lane = static_cast<uint16_t>(lane < 0 ? lane_ : static_cast<uint32_t>(lane));
    r.socket = socket;
    r.op = op;
    r.dep_type = dep_type;
    r.dep_id = dep_id;
    r.flags = flags;
    return recorder_.Record(r);
  }

  void Close() {
    Status st;
    {
      py::gil_scoped_release release;
      st = recorder_.Close();
    }
    Check(st);
  }

  TraceRecorder& recorder() { return recorder_; }

 private:
  TraceRecorder recorder_;
  uint32_t lane_ = 0;
};

}  // namespace

void RegisterTrace(pybind11::module_& m) {
  py::class_<PyTraceRecorder>(m, "TraceRecorder",
                              R"pbdoc(The proxies' per-lane trace recorder (csrc/trace/recorder.h), for tests and tools.)pbdoc")
      .def(py::init<>())
      .def("open", &PyTraceRecorder::Open, py::arg("dir"), py::arg("rank"), py::arg("lane"),
           py::arg("clock_offset_ns") = 0, py::arg("size") = 1, py::arg("capacity") = 1 << 16,
           py::arg("flush_interval_ms") = 20, py::arg("extra_json") = "",
           R"pbdoc(Creates DIR/rank<R>.lane<J>.bin (or .p<N>.bin) and starts the flusher.)pbdoc")
      .def("record", &PyTraceRecorder::Record, py::kw_only(), py::arg("src"), py::arg("dst"), py::arg("direction"),
           py::arg("bytes"), py::arg("start_ns"), py::arg("end_ns"), py::arg("seq") = 0, py::arg("request") = py::none(),
           py::arg("name_hash") = 0, py::arg("shard_bytes") = 0, py::arg("ready_ns") = py::none(), py::arg("step") = 0,
           py::arg("segment") = 0, py::arg("lane") = -1, py::arg("socket") = 0, py::arg("op") = 1,
           py::arg("dep_type") = 0, py::arg("dep_id") = kNoRecord, py::arg("flags") = 0,
           R"pbdoc(Appends one MessageRecord; returns its id, or -1 when closed or dropped.)pbdoc")
      .def("close", &PyTraceRecorder::Close, R"pbdoc(Flushes, finalizes the metadata and closes the file.)pbdoc")
      .def_property_readonly("path", [](PyTraceRecorder& r) { return r.recorder().path(); })
      .def_property_readonly("active", [](PyTraceRecorder& r) { return r.recorder().active(); })
      .def_property_readonly("recorded", [](PyTraceRecorder& r) { return r.recorder().recorded(); })
      .def_property_readonly("dropped", [](PyTraceRecorder& r) { return r.recorder().dropped(); });
  m.attr("TRACE_RECORD_BYTES") = sizeof(MessageRecord);
  m.attr("TRACE_HEADER_BYTES") = kTraceHeaderBytes;
}
