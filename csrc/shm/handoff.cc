#include "shm/handoff.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

namespace fasthorovod {
namespace {

struct GrantMessage {
  uint32_t id;
  uint32_t reserved;
  uint64_t bytes;
};

// One GrantMessage with room for one descriptor, as sendmsg/recvmsg take it.
struct GrantEnvelope {
  GrantMessage message{};
  iovec iov{&message, sizeof(message)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};

  GrantEnvelope() {
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
  }
  GrantEnvelope(const GrantEnvelope&) = delete;  // msg points into this object
  GrantEnvelope& operator=(const GrantEnvelope&) = delete;
};

}  // namespace

Status SendSegment(int sock, uint32_t id, uint64_t bytes, int fd, Deadline deadline) {
  GrantEnvelope e;
  e.message = {id, 0, bytes};
  cmsghdr* cmsg = CMSG_FIRSTHDR(&e.msg);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(cmsg), &fd, sizeof(int));
  for (;;) {
    if (sendmsg(sock, &e.msg, MSG_DONTWAIT | MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof(e.message))) {
      return Status::Ok();
    }
    const int err = errno;
    if (err == EPIPE || err == ECONNRESET || err == ENOTCONN) return Status::Ok();  // the proxy is gone
    // EAGAIN: the proxy has not read its socket for a while; ETOOMANYREFS: too many descriptors in
    // flight for this user (RLIMIT_NOFILE). Both clear as the proxy reads.
    if (err != EINTR && err != EAGAIN && err != EWOULDBLOCK && err != ETOOMANYREFS) {
      return Status::Error(Code::kIoError, Str("handing a shared-memory segment to a proxy: ", ErrnoString(err)));
    }
    if (deadline.Expired()) {
      return Status::Error(Code::kTimeout, Str("a proxy did not take its shared-memory segments (", ErrnoString(err),
                                               "); is it stopped?"));
    }
    pollfd p{sock, POLLOUT, 0};
    poll(&p, 1, err == ETOOMANYREFS ? 10 : deadline.RemainingMs(100));
  }
}

Status ReceiveSegment(int sock, int timeout_ms, SegmentGrant* grant) {
  grant->fd = -1;
  pollfd p{sock, POLLIN, 0};
  int rc = poll(&p, 1, timeout_ms);
  if (rc < 0 && errno != EINTR) return Status::Error(Code::kIoError, Str("poll(): ", ErrnoString(errno)));
  if (rc <= 0) return Status::Ok();
  GrantEnvelope e;
  ssize_t n = recvmsg(sock, &e.msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return Status::Ok();
    return Status::Error(Code::kIoError, Str("receiving a shared-memory segment: ", ErrnoString(errno)));
  }
  int fd = -1;
  for (cmsghdr* c = CMSG_FIRSTHDR(&e.msg); c != nullptr; c = CMSG_NXTHDR(&e.msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && c->cmsg_len >= CMSG_LEN(sizeof(int))) {
      std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
    }
  }
  if (n == 0 && fd < 0) return Status::Error(Code::kAborted, "the worker closed its end of the segment socket");
  if (n != static_cast<ssize_t>(sizeof(e.message)) || fd < 0 || (e.msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
    if (fd >= 0) close(fd);
    return Status::Error(Code::kIoError, "malformed shared-memory segment message from the worker");
  }
  grant->id = e.message.id;
  grant->bytes = e.message.bytes;
  grant->fd = fd;
  return Status::Ok();
}

}  // namespace fasthorovod
