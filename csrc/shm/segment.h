// RAII POSIX shared-memory segments: created (or opened), mapped, and unmapped/unlinked exactly
// once. The worker creates every segment; proxies only open and map them. A segment is unlinked
// as soon as every process that needs it has mapped it, so a crash cannot leave it behind in
// /dev/shm; the mapping itself lives until the last process unmaps it.
#pragma once

#include <cstddef>
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

  // Creates a new segment of `bytes` (fails if the name exists) and maps it, zero-filled.
  static Status Create(const std::string& name, size_t bytes, ShmSegment* out);
  // Opens and maps an existing segment with its full size.
  static Status Open(const std::string& name, ShmSegment* out);

  // Removes the name (idempotent); the mapping stays valid.
  void Unlink();
  void Unmap();

  void* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  bool linked() const { return owner_ && !unlinked_; }

 private:
  std::string name_;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool owner_ = false;  // created by us: we unlink it on destruction if nobody did
  bool unlinked_ = false;
};

}  // namespace fasthorovod
