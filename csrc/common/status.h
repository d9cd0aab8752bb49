// Status: the one error path of the C++ core.
//
// Every fallible call returns a Status (or fills one). A failed socket, a peer that went away, a
// header that does not match: each becomes a Status with a message that names the rank, the lane,
// the peer and the likely cause. Only the binding edge turns a Status into a Python exception
// (fasthorovod.FastHorovodError); nothing in csrc/ aborts the process.
#pragma once

#include <cerrno>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>

namespace fasthorovod {

enum class Code { kOk = 0, kInvalidArgument, kIoError, kTimeout, kMismatch, kAborted, kPeerError };

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

}  // namespace fasthorovod
