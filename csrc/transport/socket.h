// TCP sockets for the proxy data plane: RAII fds, bounded connect retries, and a handshake that
// lets a proxy accept exactly the connections of its own job, ring neighbour and lane.
//
// Wiring of one lane (lane j of every rank forms one ring):
//
//   rank r-1, lane j  ──S sockets──►  rank r, lane j  ──S sockets──►  rank r+1, lane j
//
// Each proxy listens on the job's interface; it connects its S outgoing sockets to the next rank
// and sends a Hello on each ({magic, job token, rank, size, lane, socket index, config hash}),
// then accepts S sockets from the previous rank, checks each Hello and answers with an Ack, and
// finally reads the Acks of its own outgoing sockets. Connecting never waits on the peer's
// application (the kernel completes TCP handshakes from the listen backlog), so the ring cannot
// deadlock during set-up. A connection whose Hello is not exactly what is expected — foreign
// bytes, another job's token, the wrong rank or lane, a different configuration — is answered
// with a rejecting Ack where possible, closed, and set-up goes on waiting for the right one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/status.h"

namespace fasthorovod {

constexpr uint64_t kHelloMagic = 0x46484f56484c4f31ull;  // "FHOVHLO1"
constexpr size_t kTokenBytes = 16;

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket();
  Socket(Socket&& other) noexcept : fd_(other.Release()) {}
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int Release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void Close();

 private:
  int fd_ = -1;
};

// What both ends of a lane connection must agree on.
struct LinkIdentity {
  uint8_t token[kTokenBytes] = {};
  uint32_t rank = 0;  // the rank of the proxy that sends this identity
  uint32_t size = 0;
  uint32_t lane = 0;
  uint64_t config_hash = 0;
};

struct RingLinks {
  std::vector<Socket> to_next;    // we send on these
  std::vector<Socket> from_prev;  // we receive on these
};

struct RingEndpoint {
  std::string host;
  int port = 0;
};

// Binds a listening socket on host (an IPv4 address or name) with an ephemeral port.
// buffer_bytes > 0 fixes SO_SNDBUF/SO_RCVBUF of the sockets it accepts; 0 keeps autotuning.
Status Listen(const std::string& host, int buffer_bytes, Socket* listener, int* port);

// Connects S sockets to `next`, accepts S from the previous rank on `listener`, with handshakes.
// `self` is this proxy's identity; the expected previous rank is (self.rank + size - 1) % size.
Status EstablishRing(const LinkIdentity& self, const Socket& listener, const RingEndpoint& next,
                     int sockets, int socket_buffer_bytes, Deadline deadline, RingLinks* links);

// The Hello a connecting proxy sends on socket `socket_index` (exposed for tests that impersonate
// strangers).
std::string EncodeHello(const LinkIdentity& sender, uint32_t socket_index);

// Blocking-with-deadline helpers on a non-blocking fd (used for handshakes).
Status SendAll(int fd, const void* data, size_t len, Deadline deadline, const std::string& who);
Status RecvAll(int fd, void* data, size_t len, Deadline deadline, const std::string& who);

// TCP_NODELAY and O_NONBLOCK for a connected data socket.
Status ConfigureDataSocket(int fd);

// A plain connection (no handshake) to host:port, retried with backoff until the deadline while
// the peer is not listening yet; returned non-blocking with TCP_NODELAY. For control connections.
Status ConnectWithRetry(const std::string& host, int port, Deadline deadline, Socket* out);

// Accepts one connection on a non-blocking listener, waiting at most until the deadline
// (kTimeout); returned non-blocking with TCP_NODELAY.
Status AcceptOne(const Socket& listener, Deadline deadline, Socket* out);

}  // namespace fasthorovod
