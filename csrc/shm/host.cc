#include "shm/host.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>

namespace fasthorovod {
namespace {

Status CheckVersion(const HostHeader* h) {
  if (h->magic != kHostMagic || h->version != kHostVersion) {
    return Status::Error(Code::kInvalidArgument, "the host segment has a different version (stale build?)");
  }
  return Status::Ok();
}

Status CheckHeader(const HostHeader* h, uint32_t local_size, const std::string& token) {
  FHVD_RETURN_IF_ERROR(CheckVersion(h));
  if (token.size() != kTokenBytes || std::memcmp(h->token, token.data(), kTokenBytes) != 0) {
    return Status::Error(Code::kInvalidArgument, "the host segment belongs to another job");
  }
  if (local_size != 0 && h->local_size != local_size) {
    return Status::Error(Code::kInvalidArgument,
                         Str("the host segment is for ", h->local_size, " local ranks, this rank counts ", local_size));
  }
  return Status::Ok();
}

}  // namespace

Status HostSegment::Create(uint32_t local_size, const std::string& token, HostSegment* out) {
  if (local_size < 2 || local_size > kMaxLocalRanks) {
    return Status::Error(Code::kInvalidArgument,
                         Str("a host segment is for 2..", kMaxLocalRanks, " local ranks, not ", local_size));
  }
  if (token.size() != kTokenBytes) return Status::Error(Code::kInvalidArgument, "the job token has the wrong length");
  HostSegment seg;
  FHVD_RETURN_IF_ERROR(ShmSegment::Create(sizeof(HostHeader), "the host segment", &seg.segment_));
  HostHeader* h = seg.header();  // zero-filled by Create
  h->magic = kHostMagic;
  h->version = kHostVersion;
  h->local_size = local_size;
  std::memcpy(h->token, token.data(), kTokenBytes);
  *out = std::move(seg);
  return Status::Ok();
}

Status HostSegment::Open(int pid, int fd, uint32_t local_size, const std::string& token, HostSegment* out) {
  const std::string path = Str("/proc/", pid, "/fd/", fd);
  const int mine = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (mine < 0) {
    return Status::Error(Code::kIoError, Str("cannot open local rank 0's host segment (", path, "): ",
                                             ErrnoString(errno), "; the ranks of a host must run as the same "
                                             "user in one PID namespace for the hierarchical allreduce"));
  }
  HostSegment seg;
  FHVD_RETURN_IF_ERROR(ShmSegment::Map(dup(mine), sizeof(HostHeader), "the host segment", &seg.segment_));
  // Map closed its copy; keep ours so that this worker can hand the segment to its proxies.
  seg.segment_.AdoptFd(mine);
  FHVD_RETURN_IF_ERROR(CheckHeader(seg.header(), local_size, token));
  *out = std::move(seg);
  return Status::Ok();
}

Status HostSegment::Map(int fd, uint64_t bytes, HostSegment* out) {
  if (bytes < sizeof(HostHeader)) {
    close(fd);
    return Status::Error(Code::kInvalidArgument, "host segment too small");
  }
  HostSegment seg;
  FHVD_RETURN_IF_ERROR(ShmSegment::Map(fd, sizeof(HostHeader), "the host segment", &seg.segment_));
  FHVD_RETURN_IF_ERROR(CheckVersion(seg.header()));
  *out = std::move(seg);
  return Status::Ok();
}

Status HostSegment::Publish(uint32_t local_rank, uint32_t id, int fd, uint64_t bytes) {
  HostHeader* h = header();
  if (local_rank >= h->local_size) return Status::Error(Code::kInvalidArgument, "local rank out of range");
  const uint32_t n = h->num_buffers[local_rank].load(std::memory_order_relaxed);
  if (n >= kMaxHostBuffers) {
    return Status::Error(Code::kInvalidArgument,
                         Str("this worker already shares ", kMaxHostBuffers, " data buffers with the other ranks of "
                             "its host; set FASTHOROVOD_HIERARCHICAL=0"));
  }
  h->buffers[local_rank][n] = HostBufferEntry{id, fd, bytes};
  h->num_buffers[local_rank].store(n + 1, std::memory_order_release);
  return Status::Ok();
}

Status HostSegment::MapBuffer(uint32_t local_rank, uint32_t id, ShmSegment* out) const {
  const HostHeader* h = header();
  const uint32_t n = h->num_buffers[local_rank].load(std::memory_order_acquire);
  for (uint32_t i = 0; i < n; ++i) {
    const HostBufferEntry& e = h->buffers[local_rank][i];
    if (e.id != id) continue;
    const std::string path = Str("/proc/", h->worker_pid[local_rank], "/fd/", e.fd);
    const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) {
      return Status::Error(Code::kIoError, Str("cannot open data buffer ", id, " of local rank ", local_rank, " (",
                                               path, "): ", ErrnoString(errno)));
    }
    return ShmSegment::Map(fd, e.bytes, Str("data buffer ", id, " of local rank ", local_rank), out);
  }
  return Status::Error(Code::kInvalidArgument,
                       Str("local rank ", local_rank, " never shared data buffer ", id, " with its host"));
}

void RaiseHostAbort(HostHeader* host, uint32_t rank, const Status& why) {
  if (host->abort.load() == 0) host->abort_rank = rank;  // written before the flag, like the reason
  RecordAbort(&host->abort, &host->abort_code, host->abort_reason, why);
  FutexWakeAll(&host->abort);
}

}  // namespace fasthorovod
