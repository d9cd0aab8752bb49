// The negotiation protocol between each rank's member and the job's coordinator (rank 0).
//
// Every message is one frame: a 12-byte header {magic, type, payload length} and the payload,
// encoded field by field in little-endian order by WireWriter and decoded by WireReader, which
// never reads past the payload (a short or corrupt payload is a protocol error, not a crash).
//
// The connection opens with transport's authenticated handshake (socket.h, LinkPurpose::
// kNegotiation: the member proves rank, size and the job token, which never travels, and the
// coordinator proves the token back); frames follow.
//
//   member → coordinator   kWeights   this rank's lane weights (u32 n, n f64: one per lane, each
//                                     finite and > 0), for the collectives it announces from now
//                                     on: sent once at start-up (equal weights) and again whenever
//                                     they change, ordered among the announcements on the one
//                                     connection. A rank's first kWeights precedes its first
//                                     kAnnounce, and its number of lanes never changes
//                          kAnnounce  the collectives this rank has submitted since its last
//                                     announcement (a batch): each either a full description or,
//                                     when it equals one the coordinator has already run under
//                                     the same name, that description's id (the response cache);
//                                     no lane boundaries (the coordinator computes them)
//                          kJoin      this rank has joined (hvd.join)
//                          kBye       this rank shuts down
//                          kBroken    this rank's data plane failed (code, message): the job
//                                     cannot go on, every rank must be told
//   coordinator → member   kResponses a batch, in the order every rank follows: kRun (id, the
//                                     description when it is new to the members, the lane
//                                     boundaries: ShardBoundaries of the lead rank's weights, see
//                                     coordinator.h), kError (a tensor that cannot run: mismatch,
//                                     stall), kJoined (rank r's join is recorded: its hvd.join
//                                     waits for this before it goes on, so that the order of the
//                                     joins the coordinator sees follows what the ranks did),
//                                     kJoinDone (every rank has joined; the last one)
//                          kFailed    the job cannot go on (a rank disconnected)
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/status.h"

namespace fasthorovod {

constexpr uint32_t kNegotiationMagic = 0x464e4731u;  // "FNG1"
constexpr uint32_t kMaxFrameBytes = 64u << 20;      // a bound on what a peer may make us allocate
constexpr uint32_t kNoId = 0xffffffffu;
constexpr size_t kMaxShapeText = 1u << 20;          // the shapes of a grouped collective, for messages
constexpr size_t kMaxPendingCollectives = 1u << 16; // submitted by some ranks, not yet by all

enum class MsgType : uint32_t {
  // 1 was kHello (the token in clear), replaced by the handshake
  kAnnounce = 2, kJoin = 3, kBye = 4, kResponses = 5, kFailed = 6, kBroken = 7,
  kWelcome = 8,  // every rank is connected: the members' start-up returns (a barrier)
  kWeights = 9
};
enum class ResponseType : uint8_t { kRun = 1, kError = 2, kJoinDone = 3, kJoined = 4 };

struct FrameHead {
  uint32_t magic;
  uint32_t type;
  uint32_t length;
};
static_assert(sizeof(FrameHead) == 12, "negotiation frame header is part of the wire format");

// What every rank must agree on for one named collective (compared field by field).
struct WireDesc {
  std::string name;
  std::string shape;  // "4,5;7" for messages; shape_hash is what is compared
  uint32_t dtype = 0;
  uint32_t op = 0;
  uint64_t count = 0;
  uint64_t name_hash = 0;
  uint64_t shape_hash = 0;
  double prescale = 1.0;
  double postscale = 1.0;
};

inline bool operator==(const WireDesc& a, const WireDesc& b) {
  return a.name == b.name && a.dtype == b.dtype && a.op == b.op && a.count == b.count &&
         a.name_hash == b.name_hash && a.shape_hash == b.shape_hash && a.prescale == b.prescale &&
         a.postscale == b.postscale;
}

class WireWriter {
 public:
  void U8(uint8_t v) { Raw(&v, 1); }
  void U32(uint32_t v) { Raw(&v, 4); }
  void U64(uint64_t v) { Raw(&v, 8); }
  void F64(double v) { Raw(&v, 8); }
  void Text(const std::string& s) {
    U32(static_cast<uint32_t>(s.size()));
    Raw(s.data(), s.size());
  }
  void U64s(const std::vector<uint64_t>& v) {
    U32(static_cast<uint32_t>(v.size()));
    for (uint64_t x : v) U64(x);
  }
  void F64s(const std::vector<double>& v) {
    U32(static_cast<uint32_t>(v.size()));
    for (double x : v) F64(x);
  }
  void Desc(const WireDesc& d) {
    Text(d.name);
    Text(d.shape);
    U32(d.dtype);
    U32(d.op);
    U64(d.count);
    U64(d.name_hash);
    U64(d.shape_hash);
    F64(d.prescale);
    F64(d.postscale);
  }
  void Bytes(const std::string& raw) { buf_ += raw; }
  const std::string& body() const { return buf_; }
  void Clear() { buf_.clear(); }
  // The whole frame: header + what was written so far.
  std::string Frame(MsgType type) const {
    FrameHead head{kNegotiationMagic, static_cast<uint32_t>(type), static_cast<uint32_t>(buf_.size())};
    return std::string(reinterpret_cast<const char*>(&head), sizeof(head)) + buf_;
  }

 private:
  void Raw(const void* p, size_t n) { buf_.append(static_cast<const char*>(p), n); }
  std::string buf_;
};

class WireReader {
 public:
  explicit WireReader(const std::string& payload) : p_(payload.data()), left_(payload.size()) {}
  bool ok() const { return ok_; }
  bool done() const { return left_ == 0; }
  uint8_t U8() { return Get<uint8_t>(); }
  uint32_t U32() { return Get<uint32_t>(); }
  uint64_t U64() { return Get<uint64_t>(); }
  double F64() { return Get<double>(); }
  std::string Text() {
    uint32_t n = U32();
    if (!ok_ || n > left_) return Fail<std::string>();
    std::string s(p_, n);
    p_ += n;
    left_ -= n;
    return s;
  }
  std::vector<uint64_t> U64s() {
    uint32_t n = U32();
    if (!ok_ || static_cast<uint64_t>(n) * 8 > left_) return Fail<std::vector<uint64_t>>();
    std::vector<uint64_t> v(n);
    for (auto& x : v) x = U64();
    return v;
  }
  std::vector<double> F64s() {
    uint32_t n = U32();
    if (!ok_ || static_cast<uint64_t>(n) * 8 > left_) return Fail<std::vector<double>>();
    std::vector<double> v(n);
    for (auto& x : v) x = F64();
    return v;
  }
  WireDesc Desc() {
    WireDesc d;
    d.name = Text();
    d.shape = Text();
    d.dtype = U32();
    d.op = U32();
    d.count = U64();
    d.name_hash = U64();
    d.shape_hash = U64();
    d.prescale = F64();
    d.postscale = F64();
    return d;
  }

 private:
  template <typename T>
  T Get() {
    T v{};
    if (!ok_ || left_ < sizeof(T)) return Fail<T>();
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    left_ -= sizeof(T);
    return v;
  }
  template <typename T>
  T Fail() {
    ok_ = false;
    left_ = 0;
    return T{};
  }
  const char* p_;
  size_t left_;
  bool ok_ = true;
};

}  // namespace fasthorovod

namespace fasthorovod {

// Bounds on what a peer says, checked before anything is allocated or indexed for it. Every
// failure is a protocol error (Code::kIoError) naming `who` (the peer), the tensor and the field.
//
// The largest collective this host accepts from the network: its physical memory. A joined
// rank allocates a zero buffer of the size a run order names, so the bound is what a legitimate
// tensor can be at most; MemberOptions/CoordinatorOptions carry it (tests lower it).
uint64_t DefaultMaxTensorBytes();
// name (1..kNameBytes-1 bytes), shape text, dtype, op, count x element size (no overflow, <= max).
Status CheckWireDesc(const WireDesc& d, uint64_t max_tensor_bytes, const std::string& who);
// Lane boundaries of a collective of `count` elements: 2..kMaxLanes+1 entries (exactly
// lanes + 1 when lanes > 0), starting at 0, never decreasing, ending at count.
Status CheckLaneBounds(const std::vector<uint64_t>& bounds, uint64_t count, uint32_t lanes, const std::string& tensor,
                       const std::string& who);

// What is wrong with lane weights ("" when nothing): 1..kMaxLanes entries (exactly `lanes` when
// lanes > 0), each finite and > 0, their sum finite. The caller words the error (a protocol error
// on the coordinator, an invalid argument on the member and in the binding).
std::string LaneWeightsProblem(const std::vector<double>& weights, uint32_t lanes);
// The one computation of lane boundaries: lane j of a collective of `count` elements takes
// [bounds[j], bounds[j+1]), its share proportional to weights[j]. bounds[j] = floor(count *
// (w_0 + ... + w_{j-1}) / total) in double (the partial and total sums added left to right), 0
// first, count last. `weights` must pass LaneWeightsProblem. The coordinator cuts every run order
// by it (the lead rank's weights; an allgather's row by equal shares), and the workers lay out an
// allgather's row by it (_C.shard_boundaries).
std::vector<uint64_t> ShardBoundaries(uint64_t count, const std::vector<double>& weights);

// Sends one whole frame (bounded by the deadline).
Status SendFrame(int fd, const std::string& frame, Deadline deadline, const std::string& who);
// Receives one whole frame; *type and *payload hold it. A bad magic or an oversized length is a
// protocol error naming `who`; the payload grows as its bytes arrive (a header that promises
// kMaxFrameBytes and sends nothing commits no memory).
// *broken_protocol (if set) tells a frame that breaks the protocol from a lost connection.
Status RecvFrame(int fd, Deadline deadline, const std::string& who, MsgType* type, std::string* payload,
                 bool* broken_protocol = nullptr);

}  // namespace fasthorovod
