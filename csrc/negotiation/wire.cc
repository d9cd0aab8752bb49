#include "negotiation/wire.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>

#include "common/collective.h"
#include "common/dtype.h"
#include "shm/channel.h"
#include "transport/socket.h"

namespace fasthorovod {

uint64_t DefaultMaxTensorBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return uint64_t{1} << 40;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
}

Status CheckWireDesc(const WireDesc& d, uint64_t max_tensor_bytes, const std::string& who) {
  auto bad = [&](const std::string& field) {
    const std::string name = d.name.substr(0, kNameBytes);
    return Status::Error(Code::kIoError, Str("protocol error: ", who, " described tensor '", name, "' with ", field));
  };
  if (d.name.empty() || d.name.size() >= kNameBytes) return bad(Str("a name of ", d.name.size(), " bytes (1..", kNameBytes - 1, " allowed)"));
  if (d.shape.size() > kMaxShapeText) return bad(Str("a shape text of ", d.shape.size(), " bytes (at most ", kMaxShapeText, ")"));
  if (!DTypeValid(d.dtype)) return bad(Str("dtype code ", d.dtype, " (not a dtype)"));
  if (d.op > static_cast<uint32_t>(ReduceOp::kAlltoall)) return bad(Str("op code ", d.op, " (not an op)"));
  if (WireCompressed(static_cast<DType>(d.dtype)) && d.op > static_cast<uint32_t>(ReduceOp::kAverage) &&
      d.op != static_cast<uint32_t>(ReduceOp::kReduceScatter)) {
    return bad(Str("op code ", d.op, " for dtype code ", d.dtype, " (a compression of sums only)"));
  }
  const uint64_t elem = DTypeSize(static_cast<DType>(d.dtype));
  if (d.count > max_tensor_bytes / elem) {
    return bad(Str("count ", d.count, " (", elem, "-byte elements: more than the ", max_tensor_bytes,
                   " bytes this host accepts for one collective)"));
  }
  return Status::Ok();
}

Status CheckLaneBounds(const std::vector<uint64_t>& bounds, uint64_t count, uint32_t lanes, const std::string& tensor,
                       const std::string& who) {
  auto bad = [&](const std::string& what) {
    return Status::Error(Code::kIoError, Str("protocol error: ", who, " sent lane boundaries for tensor '", tensor,
                                             "' that ", what));
  };
  if (bounds.size() < 2 || bounds.size() > kMaxLanes + 1) {
    return bad(Str("have ", bounds.size(), " entries (2..", kMaxLanes + 1, " allowed)"));
  }
  if (lanes > 0 && bounds.size() != lanes + 1) return bad(Str("have ", bounds.size(), " entries for ", lanes, " lanes"));
  if (bounds.front() != 0) return bad(Str("start at ", bounds.front(), ", not 0"));
  if (bounds.back() != count) return bad(Str("end at ", bounds.back(), ", not at its count ", count));
  for (size_t i = 1; i < bounds.size(); ++i) {
    if (bounds[i] < bounds[i - 1]) return bad(Str("decrease (entry ", i, ": ", bounds[i], " < ", bounds[i - 1], ")"));
  }
  return Status::Ok();
}

std::string LaneWeightsProblem(const std::vector<double>& weights, uint32_t lanes) {
  if (weights.empty() || weights.size() > kMaxLanes) {
    return Str(weights.size(), " entries (1..", kMaxLanes, " allowed)");
  }
  if (lanes > 0 && weights.size() != lanes) return Str(weights.size(), " entries for ", lanes, " lanes");
  double total = 0.0;
  for (size_t j = 0; j < weights.size(); ++j) {
    if (!std::isfinite(weights[j]) || !(weights[j] > 0.0)) {
      return Str("entry ", j, " = ", weights[j], " (each must be finite and > 0)");
    }
    total += weights[j];
  }
  if (!std::isfinite(total)) return Str("a sum of ", total, " (it must be finite)");
  return "";
}

std::vector<uint64_t> ShardBoundaries(uint64_t count, const std::vector<double>& weights) {
  double total = 0.0;
  for (double w : weights) total += w;
  std::vector<uint64_t> bounds;
  bounds.reserve(weights.size() + 1);
  bounds.push_back(0);
  double acc = 0.0;
  for (size_t j = 0; j + 1 < weights.size(); ++j) {
    acc += weights[j];
    const double at = static_cast<double>(count) * acc / total;
    // Never past count nor below the previous boundary (only extreme weights could round there).
    uint64_t b = at < static_cast<double>(count) ? static_cast<uint64_t>(at) : count;
    bounds.push_back(std::min(count, std::max(bounds.back(), b)));
  }
  bounds.push_back(count);
  return bounds;
}

Status SendFrame(int fd, const std::string& frame, Deadline deadline, const std::string& who) {
  return SendAll(fd, frame.data(), frame.size(), deadline, who);
}

Status RecvFrame(int fd, Deadline deadline, const std::string& who, MsgType* type, std::string* payload,
                 bool* broken_protocol) {
  if (broken_protocol != nullptr) *broken_protocol = false;
  FrameHead head{};
  FHVD_RETURN_IF_ERROR(RecvAll(fd, &head, sizeof(head), deadline, who));
  if (broken_protocol != nullptr) *broken_protocol = head.magic != kNegotiationMagic || head.length > kMaxFrameBytes;
  if (head.magic != kNegotiationMagic) {
    return Status::Error(Code::kIoError, Str("corrupt negotiation frame from ", who, " (bad magic)"));
  }
  if (head.length > kMaxFrameBytes) {
    return Status::Error(Code::kIoError, Str("negotiation frame from ", who, " too large (length field ", head.length,
                                             " bytes, at most ", kMaxFrameBytes, ")"));
  }
  // Grow as the bytes arrive: a length is a promise, not a reason to commit memory.
  constexpr size_t kStep = 1u << 20;
  payload->clear();
  size_t got = 0;
  while (got < head.length) {
    const size_t n = std::min<size_t>(head.length - got, kStep);
    payload->resize(got + n);
    Status st = RecvAll(fd, payload->data() + got, n, deadline, who);
    if (!st.ok()) {
      if (broken_protocol != nullptr) *broken_protocol = true;
      return st.WithContext(Str("negotiation frame from ", who, " cut short after ", got, " of ", head.length,
                                " payload bytes: "));
    }
    got += n;
  }
  *type = static_cast<MsgType>(head.type);
  return Status::Ok();
}

}  // namespace fasthorovod
