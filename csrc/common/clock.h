// Monotonic time helpers and deadlines: every wait in the data plane is bounded by one.
#pragma once

#include <chrono>
#include <cstdint>

namespace fasthorovod {

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A point in time after which a wait gives up. Deadline::Never() never expires.
class Deadline {
 public:
  static Deadline After(double seconds) { return Deadline(NowNs() + static_cast<int64_t>(seconds * 1e9)); }
  static Deadline Never() { return Deadline(INT64_MAX); }
  bool Expired() const { return NowNs() >= at_ns_; }
  // Milliseconds left, clamped to [0, cap_ms]; for poll()/futex timeouts in slices.
  int RemainingMs(int cap_ms) const {
    int64_t left = (at_ns_ - NowNs()) / 1000000;
    if (left < 0) return 0;
    return left > cap_ms ? cap_ms : static_cast<int>(left);
  }

 private:
  explicit Deadline(int64_t at_ns) : at_ns_(at_ns) {}
  int64_t at_ns_;
};

}  // namespace fasthorovod
