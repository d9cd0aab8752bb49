#include "transport/socket.h"

#include "common/hmac.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <thread>

namespace fasthorovod {
namespace {

// The handshake's messages (socket.h). Fixed layouts without padding; the Hello's bytes, as sent,
// are what both MACs cover.
struct Hello {
  uint64_t magic;
  uint32_t purpose;
  uint32_t rank;
  uint32_t size;
  uint32_t lane;
  uint32_t socket_index;
  uint32_t reserved;
  uint64_t config_hash;
  uint8_t nonce[kNonceBytes];
};
static_assert(sizeof(Hello) == 56, "the Hello is part of the wire format");

struct Challenge {
  uint64_t magic;
  uint8_t nonce[kNonceBytes];
};

struct Proof {
  uint8_t mac[kSha256Bytes];
};

struct Ack {
  uint64_t magic;
  uint32_t accepted;
  uint32_t reserved;
  uint8_t mac[kSha256Bytes];
  char reason[112];
};
static_assert(sizeof(Ack) == 160, "the Ack is part of the wire format");

// The MAC of one side: HMAC(token, label ‖ Hello ‖ Ns ‖ server rank [‖ accepted ‖ reason]).
Digest HandshakeMac(const void* token, const char* label, const Hello& hello, const uint8_t* server_nonce,
                    uint32_t server_rank, const Ack* ack) {
  std::string m(label, std::strlen(label) + 1);
  m.append(reinterpret_cast<const char*>(&hello), sizeof(hello));
  m.append(reinterpret_cast<const char*>(server_nonce), kNonceBytes);
  m.append(reinterpret_cast<const char*>(&server_rank), sizeof(server_rank));
  if (ack != nullptr) {
    m.append(reinterpret_cast<const char*>(&ack->accepted), sizeof(ack->accepted));
    m.append(ack->reason, sizeof(ack->reason));
  }
  return HmacSha256(token, kTokenBytes, m.data(), m.size());
}
constexpr const char* kClientLabel = "fasthorovod handshake v2: client";
constexpr const char* kServerLabel = "fasthorovod handshake v2: server";

Status SetNonBlocking(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    return Status::Error(Code::kIoError, "fcntl(O_NONBLOCK): " + ErrnoString(errno));
  }
  return Status::Ok();
}

Status Resolve(const std::string& host, int port, sockaddr_in* addr) {
  std::memset(addr, 0, sizeof(*addr));
  addr->sin_family = AF_INET;
  addr->sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &addr->sin_addr) == 1) return Status::Ok();
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  int rc = getaddrinfo(host.c_str(), nullptr, &hints, &result);
  if (rc != 0 || result == nullptr) {
    return Status::Error(Code::kInvalidArgument,
                         Str("cannot resolve address '", host, "': ", gai_strerror(rc)));
  }
  addr->sin_addr = reinterpret_cast<sockaddr_in*>(result->ai_addr)->sin_addr;
  freeaddrinfo(result);
  return Status::Ok();
}

void SetBufferSizes(int fd, int buffer_bytes) {
  if (buffer_bytes <= 0) return;  // 0: leave the kernel's autotuning on
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer_bytes, sizeof(buffer_bytes));
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buffer_bytes, sizeof(buffer_bytes));
}

int64_t WaitFd(int fd, short events, Deadline deadline) {
  pollfd p{fd, events, 0};
  int ms = deadline.RemainingMs(100);
  int rc = poll(&p, 1, ms);
  return rc;
}

// One connect attempt that completes or fails before the deadline; *refused (if given) says whether
// it failed because nothing listens at the address (ECONNREFUSED).
Status ConnectOnce(const sockaddr_in& addr, int buffer_bytes, Deadline deadline, Socket* out,
                   bool* refused = nullptr) {
  if (refused != nullptr) *refused = false;
  Socket sock(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!sock.valid()) return Status::Error(Code::kIoError, "socket(): " + ErrnoString(errno));
  SetBufferSizes(sock.fd(), buffer_bytes);  // before connect, so the window scale can use it
  FHVD_RETURN_IF_ERROR(SetNonBlocking(sock.fd()));
  if (::connect(sock.fd(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (errno != EINPROGRESS) {
      if (refused != nullptr) *refused = errno == ECONNREFUSED;
      return Status::Error(Code::kIoError, "connect(): " + ErrnoString(errno));
    }
    for (;;) {
      if (deadline.Expired()) return Status::Error(Code::kTimeout, "connect() timed out");
      int rc = WaitFd(sock.fd(), POLLOUT, deadline);
      if (rc < 0 && errno != EINTR) return Status::Error(Code::kIoError, "poll(): " + ErrnoString(errno));
      if (rc > 0) break;
    }
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(sock.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      if (refused != nullptr) *refused = err == ECONNREFUSED;
      return Status::Error(Code::kIoError, "connect(): " + ErrnoString(err));
    }
  }
  *out = std::move(sock);
  return Status::Ok();
}

PeerClaim ClaimOf(const Hello& h) {
  PeerClaim c;
  c.purpose = static_cast<LinkPurpose>(h.purpose);
  c.rank = h.rank;
  c.size = h.size;
  c.lane = h.lane;
  c.socket_index = h.socket_index;
  c.config_hash = h.config_hash;
  return c;
}

// What the connection says it is (not yet authenticated when logged for a failed proof).
std::string Describe(const Hello& h) {
  return Str("claims rank ", h.rank, " of ", h.size, ", lane ", h.lane, ", socket ", h.socket_index);
}

// Why an authenticated ring connection is not the one we wait for, or "" if it is.
std::string RingRefusal(const PeerClaim& claim, const LinkIdentity& self, int sockets, LinkPurpose purpose) {
  const uint32_t prev = (self.rank + self.size - 1) % self.size;
  if (claim.purpose != purpose) return purpose == LinkPurpose::kRing ? "not a ring connection" : "not a probe connection";
  if (claim.size != self.size) return Str("world size ", claim.size, " != ", self.size);
  if (claim.rank != prev) return Str("sender is rank ", claim.rank, ", expected previous rank ", prev);
  if (claim.lane != self.lane) return Str("sender lane ", claim.lane, " != lane ", self.lane);
  if (claim.socket_index >= static_cast<uint32_t>(sockets)) return "socket index out of range";
  if (claim.config_hash != self.config_hash) {
    return "configuration differs (FASTHOROVOD_* settings must be equal on every rank)";
  }
  return "";
}

// One non-blocking send of a small handshake message into a fresh socket's empty buffer; a peer
// that does not let it through at once is not worth waiting for.
bool SendSmall(int fd, const void* data, size_t len) {
  ssize_t n;
  do {
    n = ::send(fd, data, len, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(len);
}

}  // namespace

Socket::~Socket() { Close(); }

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    Close();
    fd_ = other.Release();
  }
  return *this;
}

void Socket::Close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

Status ConfigureDataSocket(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return SetNonBlocking(fd);
}

void EnableLiveness(int fd, double timeout_seconds) {
  // Idle for half the timeout, then probes every eighth of it: four unanswered ones fail the
  // socket at about the timeout. TCP_USER_TIMEOUT bounds unacknowledged data likewise.
  const int idle = std::max(1, static_cast<int>(timeout_seconds / 2));
  const int interval = std::max(1, static_cast<int>(timeout_seconds / 8));
  const int count = 4;
  const int one = 1;
  const unsigned user_timeout_ms = static_cast<unsigned>(std::max(1.0, timeout_seconds) * 1000);
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
}

Status SendAll(int fd, const void* data, size_t len, Deadline deadline, const std::string& who) {
  const char* p = static_cast<const char*>(data);
  while (len > 0) {
    ssize_t n = ::send(fd, p, len, MSG_NOSIGNAL);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      return Status::Error(Code::kIoError, Str("send to ", who, ": ", ErrnoString(errno)));
    }
    if (deadline.Expired()) return Status::Error(Code::kTimeout, Str("send to ", who, " timed out"));
    WaitFd(fd, POLLOUT, deadline);
  }
  return Status::Ok();
}

namespace {

// RecvAll that also gives up when *cancel becomes true (checked at least every 100 ms).
Status RecvAllOrCancel(int fd, void* data, size_t len, Deadline deadline, const std::string& who,
                       const std::atomic<bool>* cancel) {
  char* p = static_cast<char*>(data);
  while (len > 0) {
    ssize_t n = ::recv(fd, p, len, 0);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return Status::Error(Code::kIoError, Str(who, " closed the connection"));
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      return Status::Error(Code::kIoError, Str("recv from ", who, ": ", ErrnoString(errno)));
    }
    if (deadline.Expired()) return Status::Error(Code::kTimeout, Str("recv from ", who, " timed out"));
    if (cancel != nullptr && cancel->load()) return Status::Error(Code::kAborted, "cancelled");
    WaitFd(fd, POLLIN, deadline);
  }
  return Status::Ok();
}

Hello MakeHello(const LinkIdentity& sender, LinkPurpose purpose, uint32_t socket_index) {
  Hello hello{};
  hello.magic = kHelloMagic;
  hello.purpose = static_cast<uint32_t>(purpose);
  hello.rank = sender.rank;
  hello.size = sender.size;
  hello.lane = sender.lane;
  hello.socket_index = socket_index;
  hello.config_hash = sender.config_hash;
  RandomBytes(hello.nonce, kNonceBytes);
  return hello;
}

}  // namespace

Status RecvAll(int fd, void* data, size_t len, Deadline deadline, const std::string& who) {
  return RecvAllOrCancel(fd, data, len, deadline, who, nullptr);
}

std::string EncodeHello(const LinkIdentity& sender, uint32_t socket_index) {
  Hello hello = MakeHello(sender, LinkPurpose::kRing, socket_index);
  return std::string(reinterpret_cast<const char*>(&hello), sizeof(hello));
}

Status AuthenticateToPeer(int fd, const LinkIdentity& self, LinkPurpose purpose, uint32_t socket_index,
                          uint32_t peer_rank, Deadline deadline, const std::string& who,
                          const std::atomic<bool>* cancel) {
  uint8_t probe[kNonceBytes];
  if (!RandomBytes(probe, sizeof(probe))) {
    return Status::Error(Code::kIoError, "getrandom(): " + ErrnoString(errno));
  }
  const Hello hello = MakeHello(self, purpose, socket_index);
  FHVD_RETURN_IF_ERROR(SendAll(fd, &hello, sizeof(hello), deadline, who));
  // A peer that closes before its challenge has not read our proof: it stopped accepting (gave
  // up waiting for the other ranks, shut down) or let our Hello wait past kHandshakeSeconds.
  const std::string gone =
      Str(who, " closed the connection before the handshake began: it is no longer accepting connections (it "
               "gave up waiting for the other ranks or shut down; see its own error)");
  // One that closes after our Proof refused us without saying why: to it we are a stranger
  // (another job, a different token) or not what it expects to talk to.
  const std::string refused =
      Str(who, " closed the connection during the handshake: it did not accept this connection's proof of the "
               "job token (is another job's process at that address, or was this rank given another token?)");
  Challenge challenge{};
  Status st = RecvAllOrCancel(fd, &challenge, sizeof(challenge), deadline, who, cancel);
  if (!st.ok()) return st.code() == Code::kIoError ? Status::Error(Code::kPeerError, gone) : st;
  if (challenge.magic != kHelloMagic) {
    return Status::Error(Code::kPeerError, Str(who, " does not speak this version of the FastHorovod handshake"));
  }
  Proof proof{};
  const Digest mine = HandshakeMac(self.token, kClientLabel, hello, challenge.nonce, peer_rank, nullptr);
  std::memcpy(proof.mac, mine.data(), kSha256Bytes);
  FHVD_RETURN_IF_ERROR(SendAll(fd, &proof, sizeof(proof), deadline, who));
  Ack ack{};
  st = RecvAllOrCancel(fd, &ack, sizeof(ack), deadline, who, cancel);
  if (!st.ok()) return st.code() == Code::kIoError ? Status::Error(Code::kPeerError, refused) : st;
  const Digest theirs = HandshakeMac(self.token, kServerLabel, hello, challenge.nonce, peer_rank, &ack);
  if (ack.magic != kHelloMagic || !ConstantTimeEqual(theirs.data(), ack.mac, kSha256Bytes)) {
    return Status::Error(Code::kPeerError,
                         Str(who, " did not prove that it holds this job's token (another job's process at that "
                                  "address?)"));
  }
  if (!ack.accepted) {
    ack.reason[sizeof(ack.reason) - 1] = '\0';
    return Status::Error(Code::kPeerError, Str(who, " rejected our connection: ", ack.reason));
  }
  return Status::Ok();
}

// One incoming connection whose handshake is in progress.
struct HandshakeAcceptor::Pending {
  Socket sock;
  Deadline deadline = Deadline::After(kHandshakeSeconds);
  bool proving = false;  // the Hello is in and answered; waiting for the Proof
  Hello hello{};
  Proof proof{};
  uint8_t server_nonce[kNonceBytes] = {};
  size_t have = 0;  // bytes of the message being received
};

HandshakeAcceptor::HandshakeAcceptor(std::vector<const Socket*> listeners, const void* token, uint32_t self_rank,
                                     std::string log_prefix)
    : listeners_(std::move(listeners)), self_rank_(self_rank), log_prefix_(std::move(log_prefix)) {
  std::memcpy(token_, token, kTokenBytes);
}

HandshakeAcceptor::~HandshakeAcceptor() { std::memset(token_, 0, sizeof(token_)); }

void HandshakeAcceptor::Reject(const Pending& p, const std::string& reason) {
  std::fprintf(stderr, "[fasthorovod] %s: rejected a connection (%s): %s\n", log_prefix_.c_str(),
               Describe(p.hello).c_str(), reason.c_str());
}

Status HandshakeAcceptor::Step(int max_wait_ms, const Refuse& refuse, const Take& take) {
  std::vector<pollfd> fds;
  for (const Socket* listener : listeners_) fds.push_back({listener->fd(), POLLIN, 0});
  const size_t first_pending = fds.size();
  int wait_ms = max_wait_ms;
  for (const auto& p : pending_) {
    fds.push_back({p->sock.fd(), POLLIN, 0});
    wait_ms = std::min(wait_ms, p->deadline.RemainingMs(max_wait_ms));
  }
  int rc = poll(fds.data(), fds.size(), std::max(wait_ms, 0));
  if (rc < 0 && errno != EINTR) return Status::Error(Code::kIoError, "poll(): " + ErrnoString(errno));
  // Progress the pending handshakes that have bytes (or a hang-up) waiting.
  for (size_t i = first_pending; rc > 0 && i < fds.size(); ++i) {
    if (fds[i].revents != 0) Progress(pending_[i - first_pending].get(), refuse, take);
  }
  // Drop what is finished (its socket moved out or closed) or out of time: silently.
  pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                [](const std::unique_ptr<Pending>& p) {
                                  return !p->sock.valid() || p->deadline.Expired();
                                }),
                 pending_.end());
  // Accept everything that is waiting.
  for (size_t l = 0; rc > 0 && l < first_pending; ++l) {
    if (fds[l].revents == 0) continue;
    for (;;) {
      Socket conn(::accept4(fds[l].fd, nullptr, nullptr, SOCK_CLOEXEC));
      if (!conn.valid()) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) break;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) break;  // try later
        return Status::Error(Code::kIoError, "accept(): " + ErrnoString(errno));
      }
      if (!ConfigureDataSocket(conn.fd()).ok()) continue;
      if (pending_.size() >= kMaxPending) pending_.erase(pending_.begin());  // the oldest has had its chance
      pending_.push_back(std::make_unique<Pending>());
      pending_.back()->sock = std::move(conn);
    }
  }
  return Status::Ok();
}

void HandshakeAcceptor::Progress(Pending* p, const Refuse& refuse, const Take& take) {
  char* into = p->proving ? reinterpret_cast<char*>(&p->proof) : reinterpret_cast<char*>(&p->hello);
  const size_t want = p->proving ? sizeof(p->proof) : sizeof(p->hello);
  ssize_t n;
  do {
    n = ::recv(p->sock.fd(), into + p->have, want - p->have, 0);
  } while (n < 0 && errno == EINTR);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
  if (n <= 0) {  // closed or failed before finishing: nothing to answer
    p->sock.Close();
    return;
  }
  p->have += static_cast<size_t>(n);
  if (p->have < want) return;
  p->have = 0;
  if (!p->proving) {
    if (p->hello.magic != kHelloMagic) {
      std::fprintf(stderr, "[fasthorovod] %s: rejected a connection: not a FastHorovod peer (bad magic)\n",
                   log_prefix_.c_str());
      p->sock.Close();
      return;
    }
    Challenge challenge{};
    challenge.magic = kHelloMagic;
    if (!RandomBytes(p->server_nonce, kNonceBytes)) {
      p->sock.Close();
      return;
    }
    std::memcpy(challenge.nonce, p->server_nonce, kNonceBytes);
    if (!SendSmall(p->sock.fd(), &challenge, sizeof(challenge))) p->sock.Close();
    p->proving = true;
    return;
  }
  const Digest expected = HandshakeMac(token_, kClientLabel, p->hello, p->server_nonce, self_rank_, nullptr);
  if (!ConstantTimeEqual(expected.data(), p->proof.mac, kSha256Bytes)) {
    Reject(*p, "authentication failed: job token differs (another job, or not a FastHorovod peer)");
    p->sock.Close();  // it learns nothing, not even that the Hello was well formed
    return;
  }
  // The peer holds the token: from here on it is one of ours, and is told why if refused.
  const PeerClaim claim = ClaimOf(p->hello);
  const std::string reason = refuse(claim);
  Ack ack{};
  ack.magic = kHelloMagic;
  ack.accepted = reason.empty() ? 1 : 0;
  std::strncpy(ack.reason, reason.c_str(), sizeof(ack.reason) - 1);
  const Digest mac = HandshakeMac(token_, kServerLabel, p->hello, p->server_nonce, self_rank_, &ack);
  std::memcpy(ack.mac, mac.data(), kSha256Bytes);
  const bool sent = SendSmall(p->sock.fd(), &ack, sizeof(ack));
  if (!reason.empty()) {
    Reject(*p, reason);
    p->sock.Close();
    return;
  }
  if (!sent) {
    p->sock.Close();
    return;
  }
  take(claim, std::move(p->sock));
}

Status Listen(const std::string& host, int buffer_bytes, Socket* listener, int* port) {
  sockaddr_in addr;
  FHVD_RETURN_IF_ERROR(Resolve(host, 0, &addr));
  Socket sock(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!sock.valid()) return Status::Error(Code::kIoError, "socket(): " + ErrnoString(errno));
  int one = 1;
  setsockopt(sock.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  SetBufferSizes(sock.fd(), buffer_bytes);  // accepted sockets inherit it
  if (::bind(sock.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return Status::Error(Code::kIoError, Str("bind(", host, "): ", ErrnoString(errno)));
  }
  if (::listen(sock.fd(), SOMAXCONN) != 0) return Status::Error(Code::kIoError, "listen(): " + ErrnoString(errno));
  FHVD_RETURN_IF_ERROR(SetNonBlocking(sock.fd()));
  socklen_t len = sizeof(addr);
  getsockname(sock.fd(), reinterpret_cast<sockaddr*>(&addr), &len);
  *port = ntohs(addr.sin_port);
  *listener = std::move(sock);
  return Status::Ok();
}

Status EstablishRing(const LinkIdentity& self, const RingListeners& listeners, const RingEndpoint& next,
                     int sockets, int socket_buffer_bytes, Deadline deadline, RingLinks* links,
                     LinkPurpose purpose) {
  std::vector<uint32_t> all(static_cast<size_t>(std::max(sockets, 0)));
  for (uint32_t s = 0; s < all.size(); ++s) all[s] = s;
  *links = RingLinks{};
  links->to_next.resize(all.size());
  links->from_prev.resize(all.size());
  return ConnectRingSockets(self, listeners, next, all, all, sockets, socket_buffer_bytes, deadline, links, purpose);
}

namespace {

// One connection to open: socket `index` to rank `peer` at `addr` (`name` in messages).
struct Outgoing {
  uint32_t peer = 0;
  uint32_t index = 0;
  uint8_t port = 0;  // the index of the peer's RingEndpoint::ports it connects to
  sockaddr_in addr{};
  std::string name;
  Socket sock;  // set once connected and authenticated
};

// The set-up both the rings and the mesh run: a connector thread opens `out` one after the other
// (retrying while the peer is not listening yet), each authenticated before the next, while this
// thread accepts `expected_in` connections from `listeners` that `refuse` lets in and hands them to
// `take`; strangers are rejected and waited past. `waiting` names what is still missing when the
// deadline passes. The sockets it opened are configured for data once all are in (the acceptor
// configures those it accepts). `listening`: the peers'
// listeners have been open since before their addresses were exchanged (the mesh's), so a refused
// connection means the peer's proxy is gone and set-up fails at once (kPeerError) instead of
// retrying until the deadline (after serving the other peers' handshakes for kHandshakeSeconds more);
// a ring's peer may not listen yet. `abort`, when set and raised, ends
// the wait (kAborted): the job's collectives failed elsewhere.
Status ConnectAndAccept(const LinkIdentity& self, const RingListeners& listeners, LinkPurpose purpose,
                        std::vector<Outgoing>* out, size_t expected_in, int socket_buffer_bytes, Deadline deadline,
                        const HandshakeAcceptor::Refuse& refuse, const HandshakeAcceptor::Take& take,
                        const std::function<std::string(size_t)>& waiting, bool listening = false,
                        const std::atomic<uint32_t>* abort = nullptr) {
  std::atomic<bool> cancel{false}, connector_done{false}, peer_gone{false};
  Status connected;
  std::thread connector([&] {
    for (Outgoing& o : *out) {
      Socket sock;
      int backoff_ms = 10;
      for (;;) {
        bool refused = false;
        connected = ConnectOnce(o.addr, socket_buffer_bytes, deadline, &sock, &refused);
        if (refused && listening) {
          connected = Status::Error(Code::kPeerError, "the connection was refused: its proxy is gone");
          peer_gone.store(true);
          break;
        }
        if (connected.ok() || deadline.Expired() || cancel.load()) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(backoff_ms));
        backoff_ms = backoff_ms < 500 ? backoff_ms * 2 : 500;
      }
      if (!connected.ok()) {
        connected = connected.WithContext("cannot connect to " + o.name + ": ");
        break;
      }
      connected = AuthenticateToPeer(sock.fd(), self, purpose, o.index, o.peer, deadline, o.name, &cancel);
      if (!connected.ok()) break;
      o.sock = std::move(sock);
    }
    connector_done.store(true);
  });

  size_t accepted = 0;
  Status accepting;
  HandshakeAcceptor acceptor(listeners.sockets, self.token, self.rank, Str("rank ", self.rank, " lane ", self.lane));
  auto counted = [&](const PeerClaim& claim, Socket sock) {
    take(claim, std::move(sock));
    ++accepted;
  };
  bool grace_started = false;
  Deadline grace = deadline;
  while (accepted < expected_in) {
    if (connector_done.load() && !connected.ok()) {
      // A peer whose proxy is gone: this rank still serves the others' handshakes for a moment, so
      // that each of them reaches the dead peer itself and names it, instead of seeing this rank
      // give up halfway through its own handshake.
      if (!peer_gone.load()) break;
      if (!grace_started) {
        grace = Deadline::After(kHandshakeSeconds);
        grace_started = true;
      }
      if (grace.Expired()) break;
    }
    if (abort != nullptr && abort->load() != 0) {
      accepting = Status::Error(Code::kAborted, "connection set-up stopped: the job's collectives were aborted");
      break;
    }
    if (deadline.Expired()) {
      accepting = Status::Error(Code::kTimeout, waiting(accepted));
      break;
    }
    accepting = acceptor.Step(deadline.RemainingMs(100), refuse, counted);
    if (!accepting.ok()) break;
  }
  if (!accepting.ok()) cancel.store(true);
  connector.join();
  // The connecting side's error first: a refusal by the peer names the cause (configuration).
  FHVD_RETURN_IF_ERROR(connected);
  FHVD_RETURN_IF_ERROR(accepting);
  if (accepted < expected_in) return Status::Error(Code::kAborted, "connection set-up was abandoned");
  for (Outgoing& o : *out) FHVD_RETURN_IF_ERROR(ConfigureDataSocket(o.sock.fd()));
  return Status::Ok();
}

}  // namespace

Status ConnectRingSockets(const LinkIdentity& self, const RingListeners& listeners, const RingEndpoint& next,
                          const std::vector<uint32_t>& out, const std::vector<uint32_t>& in, int sockets,
                          int socket_buffer_bytes, Deadline deadline, RingLinks* links, LinkPurpose purpose) {
  const uint32_t next_rank = (self.rank + 1) % self.size;
  const uint32_t prev_rank = (self.rank + self.size - 1) % self.size;
  if (next.ports.empty() || next.ports.size() > 255) {
    return Status::Error(Code::kInvalidArgument, Str("the next rank's ring address needs 1 to 255 ports, got ",
                                                     next.ports.size()));
  }
  const size_t num_ports = next.ports.size();
  links->to_next_port.resize(links->to_next.size(), 0);
  std::vector<Outgoing> outgoing(out.size());
  for (size_t i = 0; i < out.size(); ++i) {
    const uint32_t s = out[i];
    Outgoing& o = outgoing[i];
    o.peer = next_rank;
    o.index = s;
    // A first connection by its index, a replacement to the port after its predecessor's.
    o.port = static_cast<uint8_t>(links->to_next[s].valid() ? (links->to_next_port[s] + 1) % num_ports : s % num_ports);
    const int port = next.ports[o.port];
    o.name = Str("rank ", next_rank, " lane ", self.lane, " at ", next.host, ":", port);
    FHVD_RETURN_IF_ERROR(Resolve(next.host, port, &o.addr));
  }
  std::vector<Socket> from_prev(static_cast<size_t>(sockets));
  std::vector<bool> expected(static_cast<size_t>(sockets), false);
  for (uint32_t s : in) expected[s] = true;
  auto refuse = [&](const PeerClaim& claim) {
    std::string reason = RingRefusal(claim, self, sockets, purpose);
    if (reason.empty() && !expected[claim.socket_index]) reason = "socket index not expected now";
    if (reason.empty() && from_prev[claim.socket_index].valid()) reason = "duplicate socket index";
    return reason;
  };
  auto take = [&](const PeerClaim& claim, Socket sock) { from_prev[claim.socket_index] = std::move(sock); };
  auto waiting = [&](size_t accepted) {
    return Str("timed out waiting for rank ", prev_rank, " lane ", self.lane, " to connect (", accepted, "/",
               in.size(), " sockets); is that rank running and reachable?");
  };
  FHVD_RETURN_IF_ERROR(ConnectAndAccept(self, listeners, purpose, &outgoing, in.size(), socket_buffer_bytes, deadline,
                                        refuse, take, waiting));
  for (Outgoing& o : outgoing) {
    links->to_next[o.index] = std::move(o.sock);  // the replaced connection closes here
    links->to_next_port[o.index] = o.port;
  }
  for (uint32_t s : in) links->from_prev[s] = std::move(from_prev[s]);
  return Status::Ok();
}

Status EstablishMesh(const LinkIdentity& self, const Socket& listener, const std::vector<RingEndpoint>& peers,
                     int sockets, int socket_buffer_bytes, Deadline deadline, std::vector<RingLinks>* by_distance,
                     const std::atomic<uint32_t>* abort) {
  const uint32_t n = self.size;
  if (peers.size() != n || sockets < 1) {
    return Status::Error(Code::kInvalidArgument, Str("the mesh needs one address per rank (", peers.size(), " for ",
                                                     n, " ranks) and at least one socket per peer"));
  }
  std::vector<RingLinks> links(n);
  std::vector<Outgoing> outgoing;
  for (uint32_t d = 1; d < n; ++d) {
    links[d].to_next.resize(static_cast<size_t>(sockets));
    links[d].from_prev.resize(static_cast<size_t>(sockets));
    const uint32_t peer = (self.rank + d) % n;
    if (peers[peer].ports.size() != 1) {
      return Status::Error(Code::kInvalidArgument, Str("rank ", peer, "'s mesh address needs one port, got ",
                                                       peers[peer].ports.size()));
    }
    const int port = peers[peer].ports[0];
    sockaddr_in addr{};
    FHVD_RETURN_IF_ERROR(Resolve(peers[peer].host, port, &addr));
    const std::string name = Str("rank ", peer, " lane ", self.lane, " (mesh) at ", peers[peer].host, ":", port);
    for (int s = 0; s < sockets; ++s) {
      Outgoing o;
      o.peer = peer;
      o.index = static_cast<uint32_t>(s);
      o.addr = addr;
      o.name = name;
      outgoing.push_back(std::move(o));
    }
  }
  auto distance_of = [&](uint32_t rank) { return (self.rank + n - rank) % n; };
  auto refuse = [&](const PeerClaim& claim) -> std::string {
    if (claim.purpose != LinkPurpose::kMesh) return "not a mesh connection";
    if (claim.size != n) return Str("world size ", claim.size, " != ", n);
    if (claim.rank >= n || claim.rank == self.rank) return Str("sender is rank ", claim.rank);
    if (claim.lane != self.lane) return Str("sender lane ", claim.lane, " != lane ", self.lane);
    if (claim.socket_index >= static_cast<uint32_t>(sockets)) return "socket index out of range";
    if (claim.config_hash != self.config_hash) {
      return "configuration differs (FASTHOROVOD_* settings must be equal on every rank)";
    }
    if (links[distance_of(claim.rank)].from_prev[claim.socket_index].valid()) return "duplicate socket index";
    return "";
  };
  auto take = [&](const PeerClaim& claim, Socket sock) {
    links[distance_of(claim.rank)].from_prev[claim.socket_index] = std::move(sock);
  };
  const size_t expected = static_cast<size_t>(n - 1) * static_cast<size_t>(sockets);
  auto waiting = [&](size_t accepted) {
    std::string missing;
    for (uint32_t d = 1; d < n; ++d) {
      for (const Socket& s : links[d].from_prev) {
        if (!s.valid()) {
          missing += Str(missing.empty() ? "" : ", ", (self.rank + n - d) % n);
          break;
        }
      }
    }
    return Str("timed out waiting for the mesh of lane ", self.lane, " (", accepted, "/", expected,
               " sockets in; ranks still to connect: ", missing, "); are those ranks running and reachable?");
  };
  FHVD_RETURN_IF_ERROR(ConnectAndAccept(self, listener, LinkPurpose::kMesh, &outgoing, expected, socket_buffer_bytes,
                                        deadline, refuse, take, waiting, /*listening=*/true, abort));
  for (Outgoing& o : outgoing) links[(o.peer + n - self.rank) % n].to_next[o.index] = std::move(o.sock);
  *by_distance = std::move(links);
  return Status::Ok();
}

Status ConnectWithRetry(const std::string& host, int port, Deadline deadline, Socket* out) {
  sockaddr_in addr;
  FHVD_RETURN_IF_ERROR(Resolve(host, port, &addr));
  int backoff_ms = 10;
  for (;;) {
    Status st = ConnectOnce(addr, 0, deadline, out);
    if (st.ok()) return ConfigureDataSocket(out->fd());
    if (deadline.Expired()) return st.WithContext(Str("cannot connect to ", host, ":", port, ": "));
    std::this_thread::sleep_for(std::chrono::milliseconds(backoff_ms));
    backoff_ms = backoff_ms < 500 ? backoff_ms * 2 : 500;
  }
}

}  // namespace fasthorovod
