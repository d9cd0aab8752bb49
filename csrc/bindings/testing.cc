// fasthorovod_testing: entry points for tests only, kept out of the production module _C and never
// installed (CMake option FASTHOROVOD_BUILD_TESTING_MODULE writes it to tests/native/).
//
// The ring over loopback threads (_loopback_allreduce), the handshake bytes of a proxy (_hello), a
// negotiation member that holds the token and sends what it is given (_hostile_member),
// a synthetic trace written by the real recorder (_trace_selftest), the element-wise
// reductions the proxies use (reduce_sum, scale), and a kernel without pidfds (deny_pidfd_open).
// Errors raise the same exceptions as _C.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <tuple>

#include "bindings/errors.h"
#include "collectives/reduce.h"
#include "collectives/ring.h"
#include "common/clock.h"
#include "testing/no_pidfd.h"
#include "trace/recorder.h"
#include "transport/socket.h"

namespace py = pybind11;
using namespace fasthorovod;

namespace {

py::buffer_info WritableBuffer(py::buffer& b) { return b.request(true); }

// A seccomp filter under which pidfd_open fails with ENOSYS, as on Linux < 5.3. Inherited by every
// process started afterwards; irreversible.
void DenyPidfdOpen() {
  if (!testing::DenyPidfdOpen()) {
    throw std::runtime_error("installing the seccomp filter failed: " + ErrnoString(errno));
  }
}

// Opens a connection to `port` on loopback and sends `payload` (empty: nothing at all).
Socket ConnectStranger(int port, const std::string& payload) {
  Socket sock(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(sock.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    throw std::runtime_error("stranger could not connect: " + ErrnoString(errno));
  }
  if (!payload.empty()) (void)!::send(sock.fd(), payload.data(), payload.size(), MSG_NOSIGNAL);
  return sock;
}

// `buffers[r]` is rank r's data; runs the whole ring with one thread per rank over loopback TCP,
// exactly as proxies do (same handshake, same framing), and reduces in place.
// An impostor runs the client side of the handshake against rank 0: {token, rank, lane, socket
// index, config hash}.
using Impostor = std::tuple<py::bytes, uint32_t, uint32_t, uint32_t, uint64_t>;

std::vector<std::string> LoopbackAllreduce(std::vector<py::buffer> buffers, uint32_t dtype, size_t segment_bytes,
                                           int sockets, double prescale, double postscale, double timeout_seconds,
                                           const std::vector<py::bytes>& strangers, uint32_t op,
                                           const std::vector<Impostor>& impostors) {
  const uint32_t size = static_cast<uint32_t>(buffers.size());
  if (size == 0 || !DTypeValid(dtype)) ThrowInvalidArgument("need >= 1 buffer and a valid dtype");
  if (op > static_cast<uint32_t>(ReduceOp::kGather)) ThrowInvalidArgument("op must be OP_SUM, OP_AVERAGE or OP_GATHER");
  std::vector<py::buffer_info> infos;
  for (auto& b : buffers) infos.push_back(WritableBuffer(b));
  const size_t elem = DTypeSize(static_cast<DType>(dtype));
  for (auto& info : infos) {
    if (static_cast<size_t>(info.size * info.itemsize) != static_cast<size_t>(infos[0].size * infos[0].itemsize)) {
      ThrowInvalidArgument("all buffers must have the same byte length");
    }
  }
  const size_t count = static_cast<size_t>(infos[0].size * infos[0].itemsize) / elem;
  std::vector<Socket> listeners(size);
  std::vector<int> ports(size);
  for (uint32_t r = 0; r < size; ++r) Check(Listen("127.0.0.1", 0, &listeners[r], &ports[r]));
  // Strangers knock on rank 0 before its real neighbour does; set-up must reject them and go on.
  std::vector<Socket> stranger_sockets;
  for (const auto& payload : strangers) stranger_sockets.push_back(ConnectStranger(ports[0], payload));
  std::vector<LinkIdentity> impostor_ids;
  std::vector<uint32_t> impostor_sockets;
  for (const auto& [token, rank, lane, socket_index, config_hash] : impostors) {
    const std::string t = token;
    if (t.size() != kTokenBytes) ThrowInvalidArgument("an impostor's token must be 16 bytes");
    LinkIdentity id;
    std::memcpy(id.token, t.data(), kTokenBytes);
    id.rank = rank;
    id.size = size;
    id.lane = lane;
    id.config_hash = config_hash;
    impostor_ids.push_back(id);
    impostor_sockets.push_back(socket_index);
  }
  std::vector<std::string> impostor_results(impostors.size());
  std::atomic<size_t> impostors_done{0};
  std::vector<Status> results(size);
  {
    py::gil_scoped_release release;
    std::vector<std::thread> threads;
    for (size_t i = 0; i < impostor_ids.size(); ++i) {
      threads.emplace_back([&, i] {
        Socket sock;
        Deadline deadline = Deadline::After(timeout_seconds);
        Status st = ConnectWithRetry("127.0.0.1", ports[0], deadline, &sock);
        if (st.ok()) {
          st = AuthenticateToPeer(sock.fd(), impostor_ids[i], LinkPurpose::kRing, impostor_sockets[i], 0, deadline,
                                  "rank 0");
        }
        impostor_results[i] = st.ok() ? "accepted" : st.message();
        impostors_done.fetch_add(1);
      });
    }
    for (uint32_t r = 0; r < size; ++r) {
      threads.emplace_back([&, r] {
        LinkIdentity self;
        std::memset(self.token, 7, kTokenBytes);
        self.rank = r;
        self.size = size;
        RingLinks links;
        Deadline deadline = Deadline::After(timeout_seconds);
        // Rank 0's real neighbour connects after the impostors have their answers: once its ring
        // is up, rank 0 stops accepting, and an impostor still waiting would only time out.
        while (r == size - 1 && impostors_done.load() < impostor_ids.size() && !deadline.Expired()) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        if (size > 1) {
          results[r] = EstablishRing(self, listeners[r], {"127.0.0.1", {ports[(r + 1) % size]}}, sockets, 0, deadline, &links);
          if (!results[r].ok()) return;
        } else {
          links.to_next.emplace_back(-1);
          links.from_prev.emplace_back(-1);
        }
        CollectiveDesc desc;
        desc.total_bytes = desc.shard_bytes = count * elem;
        desc.dtype = dtype;
        desc.op = op;
        std::strncpy(desc.name, "loopback", kWireNameBytes - 1);
        ShardWork work{infos[r].ptr, count, static_cast<DType>(dtype), prescale, postscale};
        RingOptions options;
        options.rank = r;
        options.size = size;
        options.segment_bytes = segment_bytes;
        options.timeout_seconds = timeout_seconds;
        options.prev_name = Str("rank ", (r + size - 1) % size);
        options.next_name = Str("rank ", (r + 1) % size);
        RingStats stats;
        results[r] = RingAllreduce(links, desc, work, options, &stats);
      });
    }
    for (auto& t : threads) t.join();
  }
  for (uint32_t r = 0; r < size; ++r) Check(results[r].WithContext(Str("rank ", r, ": ")));
  return impostor_results;
}

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

PYBIND11_MODULE(fasthorovod_testing, m) {
  m.doc() = "FastHorovod test-only entry points (the production module is fasthorovod._C).";
  m.def("reduce_sum",
        [](uint32_t dtype, py::buffer dst, py::buffer src) {
          if (!DTypeValid(dtype)) ThrowInvalidArgument("invalid dtype code");
          auto d = WritableBuffer(dst);
          auto s = src.request();
          size_t bytes = static_cast<size_t>(d.size * d.itemsize);
          if (bytes != static_cast<size_t>(s.size * s.itemsize)) ThrowInvalidArgument("buffers differ in size");
          ReduceSum(static_cast<DType>(dtype), d.ptr, s.ptr, bytes / DTypeSize(static_cast<DType>(dtype)));
        },
        R"pbdoc(dst += src elementwise, with the proxies' rounding rules (tests).)pbdoc");
  m.def("scale",
        [](uint32_t dtype, py::buffer data, double factor) {
          if (!DTypeValid(dtype)) ThrowInvalidArgument("invalid dtype code");
          auto d = WritableBuffer(data);
          Scale(static_cast<DType>(dtype), d.ptr,
                static_cast<size_t>(d.size * d.itemsize) / DTypeSize(static_cast<DType>(dtype)), factor);
        });
  m.def("dtype_size", [](uint32_t dtype) {
    if (!DTypeValid(dtype)) ThrowInvalidArgument("invalid dtype code");
    return DTypeSize(static_cast<DType>(dtype));
  });
  m.def("chunk_begin", &ChunkBegin, py::arg("count"), py::arg("size"), py::arg("chunk"));
  m.def("segment_count", &SegmentCount, py::arg("chunk_elements"), py::arg("segment_elements"));
  m.def("_loopback_allreduce", &LoopbackAllreduce, py::arg("buffers"), py::arg("dtype"), py::arg("segment_bytes"),
        py::arg("sockets") = 1, py::arg("prescale") = 1.0, py::arg("postscale") = 1.0,
        py::arg("timeout_seconds") = 60.0, py::arg("strangers") = std::vector<py::bytes>(),
        py::arg("op") = static_cast<uint32_t>(ReduceOp::kSum), py::arg("impostors") = std::vector<Impostor>(),
        R"pbdoc(Test helper: ring allreduce (op OP_GATHER: allgather) among threads over loopback TCP,
in place. Each of `strangers` first connects to rank 0's listener and sends its bytes (b"" sends
nothing). Each of `impostors` (token, rank, lane, socket_index, config_hash) runs the client side
of the handshake against rank 0 during set-up; returns what each was told ("accepted", or the
error).)pbdoc");
  m.def("_hello",
        [](uint32_t rank, uint32_t size, uint32_t lane, uint32_t socket_index, uint64_t config_hash) {
          LinkIdentity id;  // the token is not part of a Hello
          id.rank = rank;
          id.size = size;
          id.lane = lane;
          id.config_hash = config_hash;
          return py::bytes(EncodeHello(id, socket_index));
        },
        py::arg("rank"), py::arg("size"), py::arg("lane"), py::arg("socket_index"), py::arg("config_hash"),
        R"pbdoc(Test helper: the first handshake message a proxy would send (with a fresh nonce).)pbdoc");
  m.def("_hostile_member",
        [](const std::string& host, int port, const py::bytes& token, uint32_t rank, uint32_t size,
           const py::bytes& payload, double timeout_seconds) {
          const std::string t = token, bytes = payload;
          if (t.size() != kTokenBytes) ThrowInvalidArgument("the token must be 16 bytes");
          Socket sock;
          {
            py::gil_scoped_release release;
            const Deadline deadline = Deadline::After(timeout_seconds);
            const std::string who = Str("the coordinator at ", host, ":", port);
            Status st = ConnectWithRetry(host, port, deadline, &sock);
            LinkIdentity self;
            std::memcpy(self.token, t.data(), kTokenBytes);
            self.rank = rank;
            self.size = size;
            if (st.ok()) st = AuthenticateToPeer(sock.fd(), self, LinkPurpose::kNegotiation, 0, 0, deadline, who);
            if (st.ok()) st = SendAll(sock.fd(), bytes.data(), bytes.size(), deadline, who);
            Check(st);
          }
          return sock.Release();
        },
        py::arg("host"), py::arg("port"), py::arg("token"), py::arg("rank"), py::arg("size"), py::arg("payload"),
        py::arg("timeout_seconds") = 30.0,
        R"pbdoc(Test helper: connects to a negotiation coordinator as `rank`, proves `token` (a
member that holds the job token), then sends `payload` — raw bytes, hostile frames — and returns
the connected socket's fd (the caller closes it).)pbdoc");
  m.def("deny_pidfd_open", &DenyPidfdOpen,
        R"pbdoc(Test helper: from now on pidfd_open fails with ENOSYS in this process and every process it
starts (a seccomp filter), as on Linux < 5.3. Irreversible.)pbdoc");
  m.def("_trace_selftest", &TraceSelftest, py::arg("dir"), py::arg("n"), py::arg("rank") = 0, py::arg("lane") = 0,
        py::arg("size") = 2, py::arg("capacity") = 0, py::arg("flush_interval_ms") = 20,
        R"pbdoc(Records n synthetic ring frames into DIR with the C++ recorder and closes it;
returns {path, records, dropped, ns_per_record}. capacity 0: large enough for n (nothing dropped).)pbdoc");
}
