// TraceRecorder: a lock-free record ring drained to a file by one background thread.
//
// Record() reserves index i with a compare-and-swap on `next_` (refusing when i would overwrite a
// slot the flusher has not written yet: the record is dropped and counted), copies the record into
// slot i mod capacity and publishes it by storing stamp = i + 1 (release). The flusher wakes every
// flush_interval_ms, walks forward from `flushed_` while stamps match (acquire), copies those
// records to a staging vector, writes them with one write() loop, and only then advances
// `flushed_`, which frees the slots. So the file holds records in id order without gaps, and a
// record id equals its position in the file.
#include "trace/recorder.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "common/clock.h"

namespace fasthorovod {
namespace {

constexpr char kMagic[8] = {'F', 'H', 'V', 'T', 'R', 'A', 'C', 'E'};

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

Status WriteFully(int fd, const void* data, size_t n, off_t offset, bool positioned) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = positioned ? pwrite(fd, p, n, offset) : write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return Status::Error(Code::kIoError, "writing the trace file: " + ErrnoString(errno));
    }
    p += w;
    n -= static_cast<size_t>(w);
    offset += w;
  }
  return Status::Ok();
}

size_t RoundUpPowerOfTwo(size_t n) {
  size_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

}  // namespace

std::string TraceFileName(uint32_t rank, uint32_t lane) { return Str("rank", rank, ".lane", lane, ".bin"); }

TraceRecorder::~TraceRecorder() { Close(); }

Status TraceRecorder::Open(const std::string& dir, uint32_t rank, uint32_t lane, int64_t clock_offset_ns) {
  TraceOptions options;
  options.dir = dir;
  options.rank = rank;
  options.lane = lane;
  options.clock_offset_ns = clock_offset_ns;
  return Open(options);
}

Status TraceRecorder::Open(const TraceOptions& options) {
  Close();  // a previous file's write error was reported by its own Close (or is moot now)
  if (options.dir.empty()) return Status::Error(Code::kInvalidArgument, "trace directory is empty");
  if (options.capacity == 0 || options.flush_interval_ms <= 0) {
    return Status::Error(Code::kInvalidArgument, "trace capacity and flush interval must be positive");
  }
  if (mkdir(options.dir.c_str(), 0777) != 0 && errno != EEXIST) {
    return Status::Error(Code::kIoError, Str("cannot create trace directory ", options.dir, ": ", ErrnoString(errno)));
  }
  // rank<R>.lane<J>.bin, or .p1, .p2, ... when a restarted proxy (hvd.restart_proxies) traces into
  // the same directory: earlier parts are never overwritten.
  std::string base = Str(options.dir, "/rank", options.rank, ".lane", options.lane);
  int fd = -1;
  std::string path;
  for (int part = 0; part < 10000 && fd < 0; ++part) {
    path = part == 0 ? base + ".bin" : Str(base, ".p", part, ".bin");
    fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0 && errno != EEXIST) {
      return Status::Error(Code::kIoError, Str("cannot create trace file ", path, ": ", ErrnoString(errno)));
    }
  }
  if (fd < 0) return Status::Error(Code::kIoError, Str("too many trace files named ", base, ".p*.bin"));

  options_ = options;
  path_ = path;
  fd_ = fd;
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  host_ = host;
  opened_ns_ = NowNs();
  closed_ns_ = 0;
  const size_t capacity = RoundUpPowerOfTwo(options.capacity);
  options_.capacity = capacity;
  slots_.reset(new Slot[capacity]);
  mask_ = capacity - 1;
  staging_.clear();
  staging_.reserve(std::min<size_t>(capacity, 4096));
  next_.store(0);
  flushed_.store(0);
  dropped_.store(0);
  write_status_ = Status::Ok();
  WriteMetadata(false);
  if (!write_status_.ok()) {
    Status st = write_status_;
    ::close(fd_);
    fd_ = -1;
    return st;
  }
  stop_ = false;
  active_.store(true, std::memory_order_release);
  flusher_ = std::thread([this] { FlushLoop(); });
  return Status::Ok();
}

int64_t TraceRecorder::Record(const MessageRecord& record) {
  if (!active_.load(std::memory_order_relaxed)) return kNoRecord;
  uint64_t i = next_.load(std::memory_order_relaxed);
  do {
    if (i - flushed_.load(std::memory_order_acquire) > mask_) {
      dropped_.fetch_add(1, std::memory_order_relaxed);
      return kNoRecord;
    }
  } while (!next_.compare_exchange_weak(i, i + 1, std::memory_order_acq_rel, std::memory_order_relaxed));
  Slot& slot = slots_[i & mask_];
  slot.record = record;
  slot.record.id = i;
  slot.stamp.store(i + 1, std::memory_order_release);
  return static_cast<int64_t>(i);
}

void TraceRecorder::FlushLoop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    wake_.wait_for(lock, std::chrono::milliseconds(options_.flush_interval_ms));
    lock.unlock();
    Drain();
    lock.lock();
  }
}

void TraceRecorder::Drain() {
  uint64_t f = flushed_.load(std::memory_order_relaxed);  // only the flusher advances it
  const uint64_t n = next_.load(std::memory_order_acquire);
  while (f < n) {
    staging_.clear();
    while (f < n && staging_.size() < staging_.capacity()) {
      const Slot& slot = slots_[f & mask_];
      if (slot.stamp.load(std::memory_order_acquire) != f + 1) break;  // reserved, not yet written
      staging_.push_back(slot.record);
      ++f;
    }
    if (staging_.empty()) break;
    if (write_status_.ok()) {
      write_status_ = WriteFully(fd_, staging_.data(), staging_.size() * sizeof(MessageRecord), 0, false);
    }
    flushed_.store(f, std::memory_order_release);
  }
}

std::string TraceRecorder::Metadata(bool closed) const {
  std::string m = Str("{\"format\": \"fasthorovod-trace\", \"version\": ", kTraceFormatVersion,
                      ", \"kind\": \"proxy\", \"rank\": ", options_.rank, ", \"size\": ", options_.size,
                      ", \"lane\": ", options_.lane, ", \"host\": ", JsonString(host_), ", \"pid\": ", getpid(),
                      ", \"clock\": \"CLOCK_MONOTONIC\", \"clock_offset_ns\": ", options_.clock_offset_ns,
                      ", \"record_bytes\": ", sizeof(MessageRecord), ", \"frame_header_bytes\": 128",
                      ", \"payload_only\": true, \"capacity\": ", options_.capacity, ", \"opened_ns\": ", opened_ns_);
  if (closed) {
    m += Str(", \"closed_ns\": ", closed_ns_, ", \"records\": ", flushed_.load(), ", \"dropped\": ", dropped_.load(),
             ", \"write_error\": ", write_status_.ok() ? "null" : JsonString(write_status_.message()));
  }
  if (!options_.extra_json.empty()) m += ", " + options_.extra_json;
  return m + "}";
}

void TraceRecorder::WriteMetadata(bool closed) {
  std::string meta = Metadata(closed);
  const size_t room = kTraceHeaderBytes - 16 - 1;
  if (meta.size() > room) {
    if (!closed) {
      write_status_ = Status::Error(Code::kInvalidArgument, "trace metadata exceeds the 4 KiB header");
      return;
    }
    return;  // keep the metadata written at Open; the reader counts records from the file size
  }
  std::string header(kTraceHeaderBytes, ' ');
  std::memcpy(&header[0], kMagic, 8);
  uint32_t version = kTraceFormatVersion, size = kTraceHeaderBytes;
  std::memcpy(&header[8], &version, 4);
  std::memcpy(&header[12], &size, 4);
  std::memcpy(&header[16], meta.data(), meta.size());
  header[kTraceHeaderBytes - 1] = '\n';
  Status st = WriteFully(fd_, header.data(), header.size(), 0, true);
  if (!closed && st.ok() && lseek(fd_, kTraceHeaderBytes, SEEK_SET) < 0) {
    st = Status::Error(Code::kIoError, "seeking in the trace file: " + ErrnoString(errno));
  }
  if (write_status_.ok()) write_status_ = st;
}

Status TraceRecorder::Close() {
  if (fd_ < 0) return Status::Ok();
  active_.store(false, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (flusher_.joinable()) flusher_.join();
  Drain();
  closed_ns_ = NowNs();
  WriteMetadata(true);
  Status st = write_status_;
  if (::close(fd_) != 0 && st.ok()) st = Status::Error(Code::kIoError, "closing the trace file: " + ErrnoString(errno));
  fd_ = -1;
  slots_.reset();
  return st.WithContext(Str("trace ", path_, ": "));
}

}  // namespace fasthorovod
