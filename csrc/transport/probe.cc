#include "transport/probe.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <thread>

namespace fasthorovod {
namespace {

constexpr uint32_t kProbeMagic = 0x52504846;  // "FHPR"
constexpr size_t kChunk = 256 << 10;

// The receiver's request to its sender: stream on sockets [0, flows); 0 ends the probe.
struct Control {
  uint32_t magic;
  uint32_t flows;
};

// Streams on the first `active` sockets as the next rank's receiver asks, until it says stop; then
// resets every socket.
Status RunSender(std::vector<Socket>& socks, Deadline deadline, const std::atomic<bool>& cancel) {
  const std::vector<char> zeros(kChunk, 0);
  Control control{};
  size_t control_got = 0;
  size_t active = 0;
  std::vector<pollfd> fds(socks.size());
  for (;;) {
    if (cancel.load()) return Status::Error(Code::kAborted, "probe abandoned");
    if (deadline.Expired()) return Status::Error(Code::kTimeout, "the next rank's probe receiver stopped asking");
    for (size_t j = 0; j < socks.size(); ++j) {
      fds[j] = {socks[j].fd(), static_cast<short>((j == 0 ? POLLIN : 0) | (j < active ? POLLOUT : 0)), 0};
    }
    if (poll(fds.data(), fds.size(), deadline.RemainingMs(50)) < 0 && errno != EINTR) {
      return Status::Error(Code::kIoError, "poll(): " + ErrnoString(errno));
    }
    if (fds[0].revents & (POLLIN | POLLHUP | POLLERR)) {
      ssize_t n = ::recv(socks[0].fd(), reinterpret_cast<char*>(&control) + control_got, sizeof(control) - control_got, 0);
      if (n == 0) return Status::Error(Code::kIoError, "the next rank closed its probe connection");
      if (n < 0 && errno != EAGAIN && errno != EINTR) return Status::Error(Code::kIoError, "probe recv(): " + ErrnoString(errno));
      if (n > 0 && (control_got += static_cast<size_t>(n)) == sizeof(control)) {
        control_got = 0;
        if (control.magic != kProbeMagic) {
          return Status::Error(Code::kPeerError, "malformed probe control from the next rank (bad magic)");
        }
        if (control.flows > socks.size()) {
          return Status::Error(Code::kPeerError, Str("malformed probe control from the next rank (flows ", control.flows,
                                                     ", only ", socks.size(), " sockets)"));
        }
        if (control.flows == 0) break;
        active = control.flows;
      }
    }
    for (size_t j = 0; j < active; ++j) {
      if (fds[j].revents & POLLERR) return Status::Error(Code::kIoError, "probe socket error towards the next rank");
      if (!(fds[j].revents & POLLOUT)) continue;
      ssize_t n = ::send(socks[j].fd(), zeros.data(), zeros.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0 && errno != EAGAIN && errno != EINTR) return Status::Error(Code::kIoError, "probe send(): " + ErrnoString(errno));
    }
  }
  // What is still queued in the send buffers (megabytes: autotuned buffers fill behind a shaped
  // link) would take 0.1-0.35 s to cross it, so it is dropped: each socket closes with a reset,
  // which the receiver takes as the end (it asked to stop, and counts nothing after).
  const linger reset{1, 0};
  for (auto& sock : socks) {
    ::setsockopt(sock.fd(), SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
    sock.Close();
  }
  return Status::Ok();
}

// The receiving end: reads whatever arrives on every socket, counting bytes per socket.
class Receiver {
 public:
  Receiver(std::vector<Socket>& socks, Deadline deadline)
      : socks_(socks), deadline_(deadline), total_(socks.size(), 0), eof_(socks.size(), false), buffer_(kChunk) {}

  // Reads until `until_ns` (or, with until_ns = 0, until every socket reached EOF).
  Status Pump(int64_t until_ns) {
    std::vector<pollfd> fds(socks_.size());
    for (;;) {
      const int64_t now = NowNs();
      if (until_ns != 0 && now >= until_ns) return Status::Ok();
      if (until_ns == 0 && std::all_of(eof_.begin(), eof_.end(), [](bool e) { return e; })) return Status::Ok();
      if (deadline_.Expired()) return Status::Error(Code::kTimeout, "the previous rank's probe sender went silent");
      for (size_t j = 0; j < socks_.size(); ++j) fds[j] = {eof_[j] ? -1 : socks_[j].fd(), POLLIN, 0};
      int wait_ms = deadline_.RemainingMs(until_ns == 0 ? 50 : static_cast<int>((until_ns - now) / 1000000) + 1);
      if (poll(fds.data(), fds.size(), wait_ms) < 0 && errno != EINTR) {
        return Status::Error(Code::kIoError, "poll(): " + ErrnoString(errno));
      }
      for (size_t j = 0; j < socks_.size(); ++j) {
        if (!(fds[j].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        ssize_t n = ::recv(socks_[j].fd(), buffer_.data(), buffer_.size(), MSG_DONTWAIT);
        if (n > 0) {
          total_[j] += static_cast<uint64_t>(n);
        } else if (n == 0 || (until_ns == 0 && errno == ECONNRESET)) {  // after the stop: its end
          if (until_ns != 0) return Status::Error(Code::kIoError, "the previous rank closed its probe connection");
          eof_[j] = true;
        } else if (errno != EAGAIN && errno != EINTR) {
          return Status::Error(Code::kIoError, "probe recv(): " + ErrnoString(errno));
        }
      }
    }
  }

  Status Ask(uint32_t flows) {
    const Control control{kProbeMagic, flows};
    return SendAll(socks_[0].fd(), &control, sizeof(control), deadline_, "the previous rank's probe");
  }

  // Runs the doubling schedule (probe.h) and drains the sender's last bytes.
  Status Measure(const ProbeOptions& options, std::vector<ProbePhase>* phases) {
    const int max_flows = static_cast<int>(socks_.size());
    if (options.min_flows < 1 || options.min_flows > max_flows) {
      return Status::Error(Code::kInvalidArgument, Str("probe min_flows must be in [1, ", max_flows, "] (the sockets "
                                                       "connected), got ", options.min_flows));
    }
    int flat_in_a_row = 0;
    for (int flows = options.min_flows;; flows = std::min(2 * flows, max_flows)) {
      FHVD_RETURN_IF_ERROR(Ask(static_cast<uint32_t>(flows)));
      FHVD_RETURN_IF_ERROR(Pump(NowNs() + static_cast<int64_t>(options.warmup_seconds * 1e9)));
      const std::vector<uint64_t> before = total_;
      const int64_t start = NowNs();
      FHVD_RETURN_IF_ERROR(Pump(start + static_cast<int64_t>(options.measure_seconds * 1e9)));
      ProbePhase phase;
      phase.flows = flows;
      phase.seconds = static_cast<double>(NowNs() - start) * 1e-9;
      for (int j = 0; j < flows; ++j) {
        const double rate = static_cast<double>(total_[j] - before[j]) / phase.seconds;
        phase.flow_bytes_per_second.push_back(rate);
        phase.bytes_per_second += rate;
      }
      const bool flat = !phases->empty() && phase.bytes_per_second < options.min_gain * phases->back().bytes_per_second;
      flat_in_a_row = flat ? flat_in_a_row + 1 : 0;
      phases->push_back(std::move(phase));
      if (flat_in_a_row == kFlatDoublingsToStop || flows == max_flows) break;
    }
    FHVD_RETURN_IF_ERROR(Ask(0));
    return Pump(0);
  }

 private:
  std::vector<Socket>& socks_;
  Deadline deadline_;
  std::vector<uint64_t> total_;
  std::vector<bool> eof_;
  std::vector<char> buffer_;
};

}  // namespace

Status ProbePath(RingLinks& links, const ProbeOptions& options, Deadline deadline, std::vector<ProbePhase>* incoming) {
  if (links.to_next.empty() || links.to_next.size() != links.from_prev.size()) {
    return Status::Error(Code::kInvalidArgument, "the probe needs the same number (>= 1) of sockets each way");
  }
  incoming->clear();
  std::atomic<bool> cancel{false};
  Status sent;
  std::thread sender([&] { sent = RunSender(links.to_next, deadline, cancel); });
  Receiver receiver(links.from_prev, deadline);
  Status received = receiver.Measure(options, incoming);
  if (!received.ok()) cancel.store(true);
  sender.join();
  FHVD_RETURN_IF_ERROR(received.WithContext("probing the path from the previous rank: "));
  return sent.WithContext("probing the path to the next rank: ");
}

}  // namespace fasthorovod
