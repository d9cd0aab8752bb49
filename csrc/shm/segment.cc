#include "shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace fasthorovod {

ShmSegment::~ShmSegment() {
  Unmap();
  if (owner_) Unlink();
}

ShmSegment::ShmSegment(ShmSegment&& other) noexcept { *this = std::move(other); }

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    Unmap();
    if (owner_) Unlink();
    name_ = std::move(other.name_);
    data_ = other.data_;
    size_ = other.size_;
    owner_ = other.owner_;
    unlinked_ = other.unlinked_;
    other.data_ = nullptr;
    other.size_ = 0;
    other.owner_ = false;
  }
  return *this;
}

Status ShmSegment::Create(const std::string& name, size_t bytes, ShmSegment* out) {
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return Status::Error(Code::kIoError, Str("shm_open(", name, ", create): ", ErrnoString(errno)));
  ShmSegment seg;
  seg.name_ = name;
  seg.owner_ = true;  // from here on the destructor unlinks the name on any error path
  const size_t map_bytes = bytes == 0 ? 1 : bytes;
  if (ftruncate(fd, static_cast<off_t>(map_bytes)) != 0) {
    int err = errno;
    close(fd);
    return Status::Error(Code::kIoError, Str("ftruncate(", name, ", ", bytes, "): ", ErrnoString(err),
                                             " (is /dev/shm large enough?)"));
  }
  void* p = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (p == MAP_FAILED) return Status::Error(Code::kIoError, Str("mmap(", name, "): ", ErrnoString(err)));
  seg.data_ = p;
  seg.size_ = bytes;
  *out = std::move(seg);
  return Status::Ok();
}

Status ShmSegment::Open(const std::string& name, ShmSegment* out) {
  int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return Status::Error(Code::kIoError, Str("shm_open(", name, "): ", ErrnoString(errno)));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int err = errno;
    close(fd);
    return Status::Error(Code::kIoError, Str("fstat(", name, "): ", ErrnoString(err)));
  }
  const size_t bytes = static_cast<size_t>(st.st_size);
  void* p = mmap(nullptr, bytes == 0 ? 1 : bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (p == MAP_FAILED) return Status::Error(Code::kIoError, Str("mmap(", name, "): ", ErrnoString(err)));
  ShmSegment seg;
  seg.name_ = name;
  seg.data_ = p;
  seg.size_ = bytes;
  *out = std::move(seg);
  return Status::Ok();
}

void ShmSegment::Unlink() {
  if (!unlinked_ && !name_.empty()) shm_unlink(name_.c_str());
  unlinked_ = true;
}

void ShmSegment::Unmap() {
  if (data_ != nullptr) munmap(data_, size_ == 0 ? 1 : size_);
  data_ = nullptr;
}

}  // namespace fasthorovod
