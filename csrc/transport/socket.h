// TCP sockets for the proxy data plane: RAII fds, bounded connect retries, and an authenticated
// handshake that lets a proxy accept exactly the connections of its own job, ring neighbour and
// lane (and the coordinator exactly its job's members).
//
// Wiring of one lane (lane j of every rank forms one ring):
//
//   rank r-1, lane j  ──S sockets──►  rank r, lane j  ──S sockets──►  rank r+1, lane j
//
// Each proxy listens on the job's interface. EstablishRing runs two things at once: a connector
// thread connects the S outgoing sockets to the next rank and runs the client side of the
// handshake on each, while the calling thread accepts from the listener and runs the server side
// of every pending connection in one poll set (each with its own 2 s deadline, so strangers that
// say nothing or send garbage cannot hold set-up up), until the S sockets of the previous rank
// are in. Connecting never waits on the peer's application, so the ring cannot deadlock.
//
// The handshake proves, in both directions, that the other end holds the 16-byte job token,
// without sending it (HMAC-SHA256, common/hmac.h):
//
//   client → server  Hello     {magic, purpose, rank, size, lane, socket index, config hash, Nc}
//   server → client  Challenge {magic, Ns}
//   client → server  Proof     HMAC(token, "client" ‖ Hello ‖ Ns ‖ server rank)
//   server → client  Ack       {accepted, reason, HMAC(token, "server" ‖ Hello ‖ Ns ‖ server rank
//                               ‖ accepted ‖ reason)}
//
// Nc and Ns are fresh random nonces (getrandom), so a recorded proof is worthless on another
// connection, and the two roles' labels differ, so one side's proof cannot be reflected as the
// other's. The server checks the Proof (constant-time comparison) before anything else: a peer
// that fails it — foreign bytes, another job's token, a truncated or silent handshake — gets no
// Ack and no reason, only a closed connection; the reason is logged locally on stderr. Only a
// peer that has proven the token is told why it is refused (wrong rank, lane, size, socket index,
// or a different configuration: a user error, reported on the rank that connected). The client
// trusts the Ack only if its MAC verifies, so it also knows it reached a process of its own job.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/status.h"

namespace fasthorovod {

constexpr uint64_t kHelloMagic = 0x46484f56484c4f32ull;  // "FHOVHLO2": the authenticated handshake
constexpr size_t kTokenBytes = 16;
constexpr size_t kNonceBytes = 16;
constexpr double kHandshakeSeconds = 2.0;  // what one incoming connection gets to prove itself

// What a connection is for; part of what the handshake authenticates.
enum class LinkPurpose : uint32_t { kRing = 1, kNegotiation = 2, kProbe = 3, kMesh = 4 };

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

// What both ends of a connection must agree on (the token is never sent).
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
  std::vector<uint8_t> to_next_port;  // per send socket: the index in RingEndpoint::ports it connected to
};

// Where a peer listens. A ring's rank listens on several ports (a lane's proxy on two, the path
// probe on kProbePorts): socket s first connects to ports[s % ports.size()], and a re-hashed
// connection goes to the port after the one its predecessor used, so a re-hash draws a new
// destination port as well as a new source port. Networks that hash a few bits of each port (a
// shaper's u32 hash, some switches' ECMP) then move it to another group of buckets; a hash of the
// whole 5-tuple re-draws on either.
struct RingEndpoint {
  std::string host;
  std::vector<int> ports;
};

// The listeners of a ring's rank, in the order of its RingEndpoint::ports.
struct RingListeners {
  RingListeners(const Socket& one) : sockets{&one} {}  // NOLINT: implicit, one listener is the common case
  RingListeners(const Socket& first, const Socket& second) : sockets{&first, &second} {}
  explicit RingListeners(const std::vector<Socket>& all) {
    for (const Socket& s : all) sockets.push_back(&s);
  }
  std::vector<const Socket*> sockets;
};

// Binds a listening socket on host (an IPv4 address or name) with an ephemeral port.
// buffer_bytes > 0 fixes SO_SNDBUF/SO_RCVBUF of the sockets it accepts; 0 keeps autotuning.
Status Listen(const std::string& host, int buffer_bytes, Socket* listener, int* port);

// Connects S sockets to `next`, accepts S from the previous rank on `listeners`, with handshakes.
// `self` is this proxy's identity; the expected previous rank is (self.rank + size - 1) % size.
// `purpose` is what both ends must be connecting for (a lane's ring, or the path probe's).
Status EstablishRing(const LinkIdentity& self, const RingListeners& listeners, const RingEndpoint& next,
                     int sockets, int socket_buffer_bytes, Deadline deadline, RingLinks* links,
                     LinkPurpose purpose = LinkPurpose::kRing);

// Connects the sockets with indices `out` to `next` and accepts those with indices `in` from the
// previous rank, as EstablishRing does (both at once, authenticated), and puts each into its place
// in `links` (whose vectors hold `sockets` entries), closing the connection it replaces. A lane
// re-hashing flows between two collectives (transport/lane.h) calls it with the sockets it
// announced and those announced to it; either list may be empty. A replaced socket connects to
// the other of next's two ports (RingEndpoint) than the connection it replaces.
Status ConnectRingSockets(const LinkIdentity& self, const RingListeners& listeners, const RingEndpoint& next,
                          const std::vector<uint32_t>& out, const std::vector<uint32_t>& in, int sockets,
                          int socket_buffer_bytes, Deadline deadline, RingLinks* links,
                          LinkPurpose purpose = LinkPurpose::kRing);

// The mesh of one lane (collectives/alltoall.h): S sockets from this rank to lane `self.lane` of
// every other rank, and S from each of them, set up at once as EstablishRing does (authenticated,
// purpose kMesh, on a listener of its own so that it never meets a ring's re-hashed connections).
// `peers[r]` is rank r's mesh address for this lane (this rank's entry is not used). The links are
// indexed by distance: (*by_distance)[d] sends to rank + d and receives from rank - d (entry 0 is
// empty), so each is shaped like a ring's links and a Lane runs on it with LaneOptions::distance d.
// The peers' mesh listeners are open from start-up on, so a refused connection fails set-up at once
// (kPeerError: that rank's proxy is gone); `abort`, if given, is polled while waiting (kAborted).
Status EstablishMesh(const LinkIdentity& self, const Socket& listener, const std::vector<RingEndpoint>& peers,
                     int sockets, int socket_buffer_bytes, Deadline deadline, std::vector<RingLinks>* by_distance,
                     const std::atomic<uint32_t>* abort = nullptr);

// What a connecting peer says it is, from its Hello; authenticated once its Proof verifies.
struct PeerClaim {
  LinkPurpose purpose = LinkPurpose::kRing;
  uint32_t rank = 0;
  uint32_t size = 0;
  uint32_t lane = 0;
  uint32_t socket_index = 0;
  uint64_t config_hash = 0;
};

// The Hello a connecting proxy sends on socket `socket_index`, with a fresh nonce (exposed for
// tests that impersonate strangers; it holds nothing secret).
std::string EncodeHello(const LinkIdentity& sender, uint32_t socket_index);

// The client side of the handshake on a connected socket: proves the token, checks that the peer
// (rank `peer_rank`) holds it too, and returns its refusal reason as a kPeerError if it refused.
// `cancel`, when set, makes it give up early (kAborted).
Status AuthenticateToPeer(int fd, const LinkIdentity& self, LinkPurpose purpose, uint32_t socket_index,
                          uint32_t peer_rank, Deadline deadline, const std::string& who,
                          const std::atomic<bool>* cancel = nullptr);

// The server side: accepts connections from a listener and runs every pending handshake at once
// in one poll set, each with its own kHandshakeSeconds deadline (at most kMaxPending; a new one
// evicts the oldest). A connection whose Proof verifies is shown to `refuse` ("" accepts it, else
// the reason it is told), and, accepted, handed to `take` non-blocking with TCP_NODELAY.
class HandshakeAcceptor {
 public:
  using Refuse = std::function<std::string(const PeerClaim&)>;
  using Take = std::function<void(const PeerClaim&, Socket)>;
  static constexpr size_t kMaxPending = 128;

  // `self_rank` is this end's rank (the one connecting peers expect); `log_prefix` names it in
  // the stderr lines about rejected connections.
  HandshakeAcceptor(const Socket& listener, const void* token, uint32_t self_rank, std::string log_prefix)
      : HandshakeAcceptor(std::vector<const Socket*>{&listener}, token, self_rank, std::move(log_prefix)) {}
  // Accepts from every listener in `listeners` (a ring rank's two ports).
  HandshakeAcceptor(std::vector<const Socket*> listeners, const void* token, uint32_t self_rank,
                    std::string log_prefix);
  ~HandshakeAcceptor();
  HandshakeAcceptor(const HandshakeAcceptor&) = delete;
  HandshakeAcceptor& operator=(const HandshakeAcceptor&) = delete;

  // Waits at most max_wait_ms for something to happen, then accepts what is waiting and
  // progresses the pending handshakes. Errors only if the listener itself fails.
  Status Step(int max_wait_ms, const Refuse& refuse, const Take& take);
  size_t pending() const { return pending_.size(); }

 private:
  struct Pending;
  void Progress(Pending* p, const Refuse& refuse, const Take& take);
  void Reject(const Pending& p, const std::string& reason);
  std::vector<const Socket*> listeners_;
  uint8_t token_[kTokenBytes];
  uint32_t self_rank_;
  std::string log_prefix_;
  std::vector<std::unique_ptr<Pending>> pending_;
};

// Blocking-with-deadline helpers on a non-blocking fd (used for handshakes).
Status SendAll(int fd, const void* data, size_t len, Deadline deadline, const std::string& who);
Status RecvAll(int fd, void* data, size_t len, Deadline deadline, const std::string& who);

// TCP_NODELAY and O_NONBLOCK for a connected data socket.
Status ConfigureDataSocket(int fd);

// For a connection that can stay idle while its peer is expected to live (the negotiation's,
// between a rank's submissions): TCP keepalive and TCP_USER_TIMEOUT so that a peer whose host
// vanished without a FIN or RST (a preempted instance, a cut link) is reported as an error within
// about `timeout_seconds`, as a dead Gloo peer is under Horovod.
void EnableLiveness(int fd, double timeout_seconds);

// A plain connection (no handshake) to host:port, retried with backoff until the deadline while
// the peer is not listening yet; returned non-blocking with TCP_NODELAY. For control connections.
Status ConnectWithRetry(const std::string& host, int port, Deadline deadline, Socket* out);


}  // namespace fasthorovod
