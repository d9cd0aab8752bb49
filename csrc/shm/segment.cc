#include "shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <vector>

#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#endif
#ifndef MFD_NOEXEC_SEAL
#define MFD_NOEXEC_SEAL 0x0008U  // Linux 6.3: data, never code (required where vm.memfd_noexec = 2)
#endif

namespace fasthorovod {
namespace {

// The value of `key` in a "key value" file (memory.stat) or "key: value kB" (/proc/meminfo, in
// bytes); false if the file or the key is missing.
bool ReadKeyed(const std::string& path, const std::string& key, uint64_t* value) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string name;
    uint64_t number = 0;
    fields >> name >> number;
    if (!name.empty() && name.back() == ':') name.pop_back();
    if (name != key || fields.fail()) continue;
    std::string unit;
    fields >> unit;
    *value = unit == "kB" ? number * 1024 : number;
    return true;
  }
  return false;
}

bool ReadNumber(const std::string& path, uint64_t* value) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return false;
  try {
    *value = std::stoull(text);
  } catch (...) {
    return false;
  }
  return true;
}

// The paths of `path` and of every cgroup above it ("/a/b" -> "/a/b", "/a", "").
std::vector<std::string> Ancestors(std::string path) {
  std::vector<std::string> out;
  while (!path.empty() && path.back() == '/') path.pop_back();
  for (;;) {
    out.push_back(path);
    if (path.empty()) break;
    path = path.substr(0, path.rfind('/'));
  }
  return out;
}

// Lowers *headroom to what the memory cgroups of this process (v2 or v1) leave free.
void CgroupHeadroom(uint64_t* headroom, std::string* source) {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    const size_t a = line.find(':');
    const size_t b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    const std::string path = line.substr(b + 1);
    bool v2 = controllers.empty();
    bool v1 = false;
    std::istringstream list(controllers);
    for (std::string c; std::getline(list, c, ',');) v1 = v1 || c == "memory";
    if (!v1 && !v2) continue;
    const std::string base = v1 ? "/sys/fs/cgroup/memory" : "/sys/fs/cgroup";
    for (const std::string& dir : Ancestors(path)) {
      uint64_t limit = 0, usage = 0, inactive = 0;
      const std::string d = base + dir;
      const bool limited = v1 ? ReadNumber(d + "/memory.limit_in_bytes", &limit) && limit < (1ull << 62)
                              : ReadNumber(d + "/memory.max", &limit);
      if (!limited || !ReadNumber(d + (v1 ? "/memory.usage_in_bytes" : "/memory.current"), &usage)) continue;
      if (!ReadKeyed(d + "/memory.stat", v1 ? "total_inactive_file" : "inactive_file", &inactive)) inactive = 0;
      const uint64_t free = limit > usage ? limit - usage + inactive : inactive;
      if (free < *headroom) {
        *headroom = free;
        *source = Str("the limit of memory cgroup ", dir.empty() ? "/" : dir, " (", HumanBytes(limit), ", ",
                      HumanBytes(usage), " in use)");
      }
    }
  }
}

}  // namespace

std::string HumanBytes(uint64_t bytes) {
  char text[32];
  if (bytes >= (1ull << 30)) {
    std::snprintf(text, sizeof(text), "%.1f GiB", static_cast<double>(bytes) / (1ull << 30));
  } else {
    std::snprintf(text, sizeof(text), "%.1f MiB", static_cast<double>(bytes) / (1ull << 20));
  }
  return text;
}

uint64_t MemoryHeadroom(std::string* source) {
  uint64_t headroom = UINT64_MAX;
  *source = "unknown";
  if (ReadKeyed("/proc/meminfo", "MemAvailable", &headroom)) *source = "MemAvailable in /proc/meminfo";
  CgroupHeadroom(&headroom, source);
  return headroom;
}

ShmSegment::~ShmSegment() {
  Unmap();
  CloseFd();
}

ShmSegment::ShmSegment(ShmSegment&& other) noexcept { *this = std::move(other); }

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    Unmap();
    CloseFd();
    data_ = other.data_;
    size_ = other.size_;
    fd_ = other.fd_;
    other.data_ = nullptr;
    other.size_ = 0;
    other.fd_ = -1;
  }
  return *this;
}

Status ShmSegment::Create(size_t bytes, const std::string& what, ShmSegment* out) {
  const size_t map_bytes = bytes == 0 ? 1 : bytes;
  std::string source;
  const uint64_t headroom = MemoryHeadroom(&source);
  if (map_bytes > headroom) {
    return Status::Error(Code::kIoError,
                         Str("not enough memory for ", what, ": it needs ", HumanBytes(map_bytes), " of shared memory but only ",
                             HumanBytes(headroom), " is free (", source, "); free memory on this host, raise the "
                             "memory limit of the job's container or cgroup, or allreduce smaller tensors "
                             "(smaller gradient buckets)"));
  }
  int fd = memfd_create("fasthorovod", MFD_CLOEXEC | MFD_NOEXEC_SEAL);
  if (fd < 0 && errno == EINVAL) fd = memfd_create("fasthorovod", MFD_CLOEXEC);  // before Linux 6.3
  if (fd < 0) {
    return Status::Error(Code::kIoError, Str("memfd_create for ", what, ": ", ErrnoString(errno),
                                             " (FastHorovod needs Linux >= 3.17 and memfd_create allowed)"));
  }
  ShmSegment seg;
  seg.fd_ = fd;  // from here on the destructor closes it on any error path
  // Reserve every page now: without this, a shortage would surface as SIGBUS (or the OOM killer)
  // when a page is first touched, in the middle of a copy or a collective.
  int rc;
  do {
    rc = fallocate(fd, 0, 0, static_cast<off_t>(map_bytes));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int err = errno;
    return Status::Error(Code::kIoError,
                         Str("not enough memory for ", what, ": reserving ", HumanBytes(map_bytes),
                             " of shared memory failed (fallocate on a memfd: ", ErrnoString(err), "); free memory "
                             "on this host, raise the memory limit of the job's container or cgroup, or allreduce "
                             "smaller tensors (smaller gradient buckets)"));
  }
  void* p = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return Status::Error(Code::kIoError, Str("mmap of ", what, ": ", ErrnoString(errno)));
  seg.data_ = p;
  seg.size_ = bytes;
  *out = std::move(seg);
  return Status::Ok();
}

Status ShmSegment::Map(int fd, size_t bytes, const std::string& what, ShmSegment* out) {
  ShmSegment seg;
  seg.fd_ = fd;
  const size_t map_bytes = bytes == 0 ? 1 : bytes;
  struct stat st;
  if (fstat(fd, &st) != 0) return Status::Error(Code::kIoError, Str("fstat of ", what, ": ", ErrnoString(errno)));
  if (static_cast<uint64_t>(st.st_size) < map_bytes) {
    return Status::Error(Code::kInvalidArgument, Str(what, " holds ", st.st_size, " bytes, not ", map_bytes));
  }
  void* p = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return Status::Error(Code::kIoError, Str("mmap of ", what, ": ", ErrnoString(errno)));
  seg.data_ = p;
  seg.size_ = bytes;
  seg.CloseFd();
  *out = std::move(seg);
  return Status::Ok();
}

void ShmSegment::Unmap() {
  if (data_ != nullptr) munmap(data_, size_ == 0 ? 1 : size_);
  data_ = nullptr;
}

void ShmSegment::CloseFd() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

}  // namespace fasthorovod
