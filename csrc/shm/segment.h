// RAII shared-memory segments without names: anonymous memfds (memfd_create), mapped shared.
//
// The worker creates every segment; a proxy gets the segment's file descriptor over a Unix socket
// (shm/handoff.h) and maps it. Nothing is ever named in /dev/shm, so no crash of any process at
// any moment can leave a segment behind: the memory goes away with the last mapping or descriptor,
// which the kernel drops when the processes exit. A memfd lives in the kernel's internal shmem
// mount, so it is bounded by memory (and the cgroup's limit), not by the size of /dev/shm (64 MiB
// in a default Docker container).
//
// Never a SIGBUS: a segment's pages are reserved when it is created (fallocate), after a check
// that the memory is there at all (MemAvailable, the cgroup's limit); a shortage is an error that
// names the size needed, what is short and what to do, at creation, never a signal at first touch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/status.h"

namespace fasthorovod {

class ShmSegment {
 public:
  ShmSegment() = default;
  ~ShmSegment();
  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // Creates a zero-filled segment of `bytes` whose pages are reserved, and maps it. `what` names
  // the segment in errors ("a 256 MiB data buffer") and in /proc/<pid>/fd ("memfd:fasthorovod").
  // The segment keeps its descriptor until CloseFd() (to be handed to proxies first).
  static Status Create(size_t bytes, const std::string& what, ShmSegment* out);
  // Maps the segment behind `fd` (received from the worker), which must hold at least `bytes`;
  // takes ownership of fd (closed here, on success or not).
  static Status Map(int fd, size_t bytes, const std::string& what, ShmSegment* out);

  void Unmap();
  void CloseFd();  // the mapping stays valid
  void AdoptFd(int fd) {  // keeps `fd` (a descriptor of this segment) as its own, closed with it
    CloseFd();
    fd_ = fd;
  }

  void* data() const { return data_; }
  size_t size() const { return size_; }
  int fd() const { return fd_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;
};

// Bytes this process could still fill without running out of memory: /proc/meminfo's MemAvailable,
// and for each memory cgroup above it with a limit, limit - usage + inactive file cache. *source
// says which bound it is ("MemAvailable", "the memory cgroup /x/y limit").
uint64_t MemoryHeadroom(std::string* source);

// "256.0 MiB" (binary units, one decimal).
std::string HumanBytes(uint64_t bytes);

}  // namespace fasthorovod
