// fasthorovod._C: the proxy trace recorder (csrc/trace/recorder.h) for tests and tools.
//
// The data plane uses TraceRecorder from C++ only; these bindings exist so that the file format
// written by the real recorder is exercised from Python: tests write synthetic traces with
// `TraceRecorder.record(...)`, and `_trace_selftest` records n synthetic frames as a ring lane would
// (with the dependency chain of a ring) and reports the cost of Record() per call.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <string>

#include "bindings/errors.h"
#include "common/clock.h"
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

// Records n frames the way a lane of a ring of `size` ranks would: per collective, 2(size−1)
// steps of `segments` frames each, alternating receive and dependent send, then closes.
// ns_per_record is the loop's time per record: building it, reading the clock, Record().
py::dict TraceSelftest(const std::string& dir, uint64_t n, uint32_t rank, uint32_t lane, uint32_t size,
                       size_t capacity, int flush_interval_ms) {
  if (size < 2) ThrowInvalidArgument("size must be >= 2");
  TraceRecorder recorder;
  TraceOptions o;
  o.dir = dir;
  o.rank = rank;
  o.lane = lane;
  o.size = size;
  o.capacity = capacity > 0 ? capacity : std::max<size_t>(n, 1 << 16);
  o.flush_interval_ms = flush_interval_ms;
  o.extra_json = "\"selftest\": true";
  Check(recorder.Open(o));
  const uint32_t steps = 2 * (size - 1);
  const uint32_t segments = 4;
  const uint64_t frame_bytes = 1 << 16;
  int64_t elapsed = 0;
  uint64_t done = 0;
  {
    py::gil_scoped_release release;
    const int64_t begin = NowNs();
    int64_t last_recv[segments] = {kNoRecord, kNoRecord, kNoRecord, kNoRecord};
    for (uint64_t i = 0; done < n; ++i) {
      const uint64_t seq = i / (steps * segments);
      const uint32_t step = static_cast<uint32_t>((i / segments) % steps);
      const uint32_t segment = static_cast<uint32_t>(i % segments);
      MessageRecord send;
      send.src = rank;
      send.dst = (rank + 1) % size;
      send.direction = static_cast<uint8_t>(TraceDirection::kSend);
      send.seq = seq;
      send.request = seq;
      send.name_hash = 0x5e1f7e57;
      send.bytes = frame_bytes;
      send.shard_bytes = frame_bytes * segments * size;
      send.step = step;
      send.segment = segment;
      send.lane = static_cast<uint16_t>(lane);
      send.op = static_cast<uint8_t>(TraceOp::kAllreduce);
      send.dep_type = static_cast<uint8_t>(step == 0 ? TraceDep::kOnRequest : TraceDep::kOnReceive);
      send.dep_id = step == 0 ? kNoRecord : last_recv[segment];
      int64_t t0 = NowNs();
      send.ready_ns = send.start_ns = t0;
      send.end_ns = t0 + 1000;
      recorder.Record(send);
      if (++done >= n) break;
      MessageRecord recv = send;
      recv.src = (rank + size - 1) % size;
      recv.dst = rank;
      recv.direction = static_cast<uint8_t>(TraceDirection::kRecv);
      recv.dep_type = static_cast<uint8_t>(TraceDep::kOnPeerSend);
      recv.dep_id = kNoRecord;
      t0 = NowNs();
      recv.ready_ns = recv.start_ns = t0;
      recv.end_ns = t0 + 2000;
      last_recv[segment] = recorder.Record(recv);
      ++done;
    }
    elapsed = NowNs() - begin;
  }
  const uint64_t recorded = recorder.recorded();
  const uint64_t dropped = recorder.dropped();
  std::string path = recorder.path();
  Status st;
  {
    py::gil_scoped_release release;
    st = recorder.Close();
  }
  Check(st);
  py::dict d;
  d["path"] = path;
  d["records"] = recorded;
  d["dropped"] = dropped;
  d["ns_per_record"] = n ? static_cast<double>(elapsed) / static_cast<double>(n) : 0.0;
  return d;
}

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
  m.def("_trace_selftest", &TraceSelftest, py::arg("dir"), py::arg("n"), py::arg("rank") = 0, py::arg("lane") = 0,
        py::arg("size") = 2, py::arg("capacity") = 0, py::arg("flush_interval_ms") = 20,
        R"pbdoc(Records n synthetic ring frames into DIR with the C++ recorder and closes it;
returns {path, records, dropped, ns_per_record}. capacity 0: large enough for n (nothing dropped).)pbdoc");
  m.attr("TRACE_RECORD_BYTES") = sizeof(MessageRecord);
  m.attr("TRACE_HEADER_BYTES") = kTraceHeaderBytes;
}
