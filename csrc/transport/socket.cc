#include "transport/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <thread>

namespace fasthorovod {
namespace {

struct Hello {
  uint64_t magic;
  uint8_t token[kTokenBytes];
  uint32_t rank;
  uint32_t size;
  uint32_t lane;
  uint32_t socket_index;
  uint64_t config_hash;
};

struct Ack {
  uint64_t magic;
  uint32_t accepted;
  uint32_t reserved;
  char reason[112];
};

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

// One connect attempt that completes or fails before the deadline.
Status ConnectOnce(const sockaddr_in& addr, int buffer_bytes, Deadline deadline, Socket* out) {
  Socket sock(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!sock.valid()) return Status::Error(Code::kIoError, "socket(): " + ErrnoString(errno));
  SetBufferSizes(sock.fd(), buffer_bytes);  // before connect, so the window scale can use it
  FHVD_RETURN_IF_ERROR(SetNonBlocking(sock.fd()));
  if (::connect(sock.fd(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (errno != EINPROGRESS) return Status::Error(Code::kIoError, "connect(): " + ErrnoString(errno));
    for (;;) {
      if (deadline.Expired()) return Status::Error(Code::kTimeout, "connect() timed out");
      int rc = WaitFd(sock.fd(), POLLOUT, deadline);
      if (rc < 0 && errno != EINTR) return Status::Error(Code::kIoError, "poll(): " + ErrnoString(errno));
      if (rc > 0) break;
    }
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(sock.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) return Status::Error(Code::kIoError, "connect(): " + ErrnoString(err));
  }
  *out = std::move(sock);
  return Status::Ok();
}

std::string Describe(const Hello& h) {
  return Str("rank ", h.rank, " of ", h.size, ", lane ", h.lane, ", socket ", h.socket_index);
}

// Why `hello` is not the connection we wait for, or "" if it is.
std::string RejectReason(const Hello& hello, const LinkIdentity& self, int sockets) {
  const uint32_t prev = (self.rank + self.size - 1) % self.size;
  if (hello.magic != kHelloMagic) return "not a FastHorovod proxy (bad magic)";
  if (std::memcmp(hello.token, self.token, kTokenBytes) != 0) return "job token differs (another job)";
  if (hello.size != self.size) return Str("world size ", hello.size, " != ", self.size);
  if (hello.rank != prev) return Str("sender is rank ", hello.rank, ", expected previous rank ", prev);
  if (hello.lane != self.lane) return Str("sender lane ", hello.lane, " != lane ", self.lane);
  if (hello.socket_index >= static_cast<uint32_t>(sockets)) return "socket index out of range";
  if (hello.config_hash != self.config_hash) {
    return "configuration differs (FASTHOROVOD_* settings must be equal on every rank)";
  }
  return "";
}

Ack MakeAck(const std::string& reason) {
  Ack ack{};
  ack.magic = kHelloMagic;
  ack.accepted = reason.empty() ? 1 : 0;
  std::strncpy(ack.reason, reason.c_str(), sizeof(ack.reason) - 1);
  return ack;
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

Status RecvAll(int fd, void* data, size_t len, Deadline deadline, const std::string& who) {
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
    WaitFd(fd, POLLIN, deadline);
  }
  return Status::Ok();
}

std::string EncodeHello(const LinkIdentity& sender, uint32_t socket_index) {
  Hello hello{};
  hello.magic = kHelloMagic;
  std::memcpy(hello.token, sender.token, kTokenBytes);
  hello.rank = sender.rank;
  hello.size = sender.size;
  hello.lane = sender.lane;
  hello.socket_index = socket_index;
  hello.config_hash = sender.config_hash;
  return std::string(reinterpret_cast<const char*>(&hello), sizeof(hello));
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
  if (::listen(sock.fd(), 64) != 0) return Status::Error(Code::kIoError, "listen(): " + ErrnoString(errno));
  FHVD_RETURN_IF_ERROR(SetNonBlocking(sock.fd()));
  socklen_t len = sizeof(addr);
  getsockname(sock.fd(), reinterpret_cast<sockaddr*>(&addr), &len);
  *port = ntohs(addr.sin_port);
  *listener = std::move(sock);
  return Status::Ok();
}

Status EstablishRing(const LinkIdentity& self, const Socket& listener, const RingEndpoint& next,
                     int sockets, int socket_buffer_bytes, Deadline deadline, RingLinks* links) {
  const uint32_t next_rank = (self.rank + 1) % self.size;
  const std::string next_name = Str("rank ", next_rank, " lane ", self.lane, " at ", next.host, ":", next.port);
  sockaddr_in next_addr;
  FHVD_RETURN_IF_ERROR(Resolve(next.host, next.port, &next_addr));

  // 1. Connect S sockets to the next rank (retrying while it is not listening yet) and say Hello.
  links->to_next.clear();
  links->from_prev.clear();
  for (int s = 0; s < sockets; ++s) {
    Socket sock;
    Status st;
    int backoff_ms = 10;
    for (;;) {
      st = ConnectOnce(next_addr, socket_buffer_bytes, deadline, &sock);
      if (st.ok() || deadline.Expired()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(backoff_ms));
      backoff_ms = backoff_ms < 500 ? backoff_ms * 2 : 500;
    }
    if (!st.ok()) return st.WithContext("cannot connect to " + next_name + ": ");
    const std::string hello = EncodeHello(self, static_cast<uint32_t>(s));
    FHVD_RETURN_IF_ERROR(SendAll(sock.fd(), hello.data(), hello.size(), deadline, next_name));
    links->to_next.push_back(std::move(sock));
  }

  // 2. Accept S sockets from the previous rank; reject anything else and keep waiting.
  links->from_prev.resize(sockets);
  int accepted = 0;
  while (accepted < sockets) {
    if (deadline.Expired()) {
      return Status::Error(Code::kTimeout,
                           Str("timed out waiting for rank ", (self.rank + self.size - 1) % self.size,
                               " lane ", self.lane, " to connect (", accepted, "/", sockets,
                               " sockets); is that rank running and reachable?"));
    }
    int rc = WaitFd(listener.fd(), POLLIN, deadline);
    if (rc <= 0) continue;
    Socket conn(::accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!conn.valid()) continue;
    FHVD_RETURN_IF_ERROR(SetNonBlocking(conn.fd()));
    // A stranger gets at most two seconds to say Hello, so it cannot stall set-up.
    Deadline hello_deadline = Deadline::After(2.0);
    Hello hello{};
    if (!RecvAll(conn.fd(), &hello, sizeof(hello), hello_deadline, "incoming connection").ok()) continue;
    std::string reason = RejectReason(hello, self, sockets);
    if (reason.empty() && links->from_prev[hello.socket_index].valid()) reason = "duplicate socket index";
    Ack ack = MakeAck(reason);
    if (!SendAll(conn.fd(), &ack, sizeof(ack), hello_deadline, "incoming connection").ok()) continue;
    if (!reason.empty()) {
      fprintf(stderr, "[fasthorovod] rank %u lane %u: rejected a connection (%s): %s\n", self.rank,
              self.lane, Describe(hello).c_str(), reason.c_str());
      continue;
    }
    links->from_prev[hello.socket_index] = std::move(conn);
    ++accepted;
  }

  // 3. Read the Acks of our own outgoing sockets.
  for (auto& sock : links->to_next) {
    Ack ack{};
    FHVD_RETURN_IF_ERROR(RecvAll(sock.fd(), &ack, sizeof(ack), deadline, next_name));
    if (ack.magic != kHelloMagic || !ack.accepted) {
      ack.reason[sizeof(ack.reason) - 1] = '\0';
      return Status::Error(Code::kPeerError, Str(next_name, " rejected our connection: ", ack.reason));
    }
  }
  for (auto& sock : links->to_next) FHVD_RETURN_IF_ERROR(ConfigureDataSocket(sock.fd()));
  for (auto& sock : links->from_prev) FHVD_RETURN_IF_ERROR(ConfigureDataSocket(sock.fd()));
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

Status AcceptOne(const Socket& listener, Deadline deadline, Socket* out) {
  for (;;) {
    Socket conn(::accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC));
    if (conn.valid()) {
      *out = std::move(conn);
      return ConfigureDataSocket(out->fd());
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED) {
      return Status::Error(Code::kIoError, "accept(): " + ErrnoString(errno));
    }
    if (deadline.Expired()) return Status::Error(Code::kTimeout, "timed out waiting for a connection");
    WaitFd(listener.fd(), POLLIN, deadline);
  }
}

}  // namespace fasthorovod
