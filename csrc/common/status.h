// Status: the one error path of the C++ core.
//
// Every fallible call returns a Status (or fills one). A failed socket, a peer that went away, a
// header that does not match: each becomes a Status with a message that names the rank, the lane,
// the peer and the likely cause, and carries a Code that says what kind of failure it is. Only the
// binding edge (csrc/bindings/errors.h) turns a Status into a Python exception; nothing in csrc/
// aborts the process.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>

namespace fasthorovod {

// The kind of a failure. It travels with the message everywhere: in abort frames between ranks, in
// shared memory from a proxy to its worker, and across the binding edge, where one converter
// (fasthorovod.exceptions.error_for) picks the exception class from it. Values are part of the
// shared-memory and wire formats: append only.
enum class Code : uint32_t {
  kOk = 0,
  kInvalidArgument = 1,  // the caller asked for something impossible (ValueError in Python)
  kIoError = 2,          // a socket failed or a neighbour closed its connection
  kTimeout = 3,          // nothing moved for the no-progress timeout
  kMismatch = 4,         // ranks issued different collectives
  kAborted = 5,          // the job is shutting down (or its worker died)
  kPeerError = 6,        // another rank failed and told us, without a more specific kind
  kProxyDied = 7,        // one of this worker's own proxy processes exited
};
constexpr uint32_t kNumCodes = 8;

// Stable lower-case names ("timeout", "mismatch", ...), the keys of the Python converter's table.
inline const char* CodeName(Code code) {
  switch (code) {
    case Code::kOk: return "ok";
    case Code::kInvalidArgument: return "invalid_argument";
    case Code::kIoError: return "io_error";
    case Code::kTimeout: return "timeout";
    case Code::kMismatch: return "mismatch";
    case Code::kAborted: return "aborted";
    case Code::kPeerError: return "peer_error";
    case Code::kProxyDied: return "proxy_died";
  }
  return "peer_error";
}

// A code read from shared memory or the wire: unknown values become kPeerError, never kOk.
inline Code CodeFromWire(uint32_t value) {
  return value == 0 || value >= kNumCodes ? Code::kPeerError : static_cast<Code>(value);
}

class Status {
 public:
  Status() = default;
  static Status Ok() { return Status(); }
  static Status Error(Code code, std::string message) { return Status(code, std::move(message)); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

  // Prefixes context ("rank 1 lane 0: ") to the message, keeping the code.
  Status WithContext(const std::string& context) const {
    return ok() ? *this : Status(code_, context + message_);
  }

 private:
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  Code code_ = Code::kOk;
  std::string message_;
};

// Builds a message from stream-able pieces: Str("rank ", r, " lane ", j).
template <typename... Args>
std::string Str(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

inline std::string ErrnoString(int err) { return std::string(std::strerror(err)); }

#define FHVD_RETURN_IF_ERROR(expr)        \
  do {                                    \
    ::fasthorovod::Status _st = (expr);   \
    if (!_st.ok()) return _st;            \
  } while (0)

// The kind a failure keeps when another rank reports it: a mismatch or a timeout is the same
// problem everywhere; anything else (a dead proxy, a bad request, a broken socket over there) is a
// peer's failure from this rank's point of view.
inline Code CodeFromPeer(Code code) {
  return code == Code::kMismatch || code == Code::kTimeout ? code : Code::kPeerError;
}

}  // namespace fasthorovod
