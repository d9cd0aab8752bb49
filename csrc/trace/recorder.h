// The proxy's half of the DLC trace: one record per frame sent or received on a lane.
//
// SketchDLC traced a parameter server with one record per message {id, src, dst, length, seq,
// operation, dependency type, dependency time, timestamp, id of the record depended on}. The
// FastHorovod data plane has no servers: each lane runs a ring, and a "message" is one frame (one
// segment of one chunk at one ring step, docs/dataplane.md). A TraceRecorder keeps one
// MessageRecord per frame, in memory, and a background thread appends them to
//
//     DIR/rank<R>.lane<J>.bin        (DIR/rank<R>.lane<J>.p<N>.bin if that name is taken)
//
// File format (little-endian; docs/trace.md is the reference, fasthorovod/trace/format.py the reader):
//   bytes [0, 8)      magic "FHVTRACE"
//   bytes [8, 12)     uint32 format version (1)
//   bytes [12, 16)    uint32 header size H (4096): records start at offset H
//   bytes [16, H)     metadata: one JSON object, UTF-8, padded with spaces and ending in '\n'
//                     {"kind": "proxy", "rank", "size", "lane", "host", "pid", "clock": "CLOCK_MONOTONIC",
//                      "clock_offset_ns", "record_bytes": 104, "frame_header_bytes": 128, "opened_ns",
//                      and, once closed, "closed_ns", "records", "dropped"; plus `extra` keys}
//   bytes [H, EOF)    MessageRecord × records, 104 bytes each, in id order (a trailing partial record,
//                     from a process that died mid-write, is ignored by the reader)
// Times are CLOCK_MONOTONIC nanoseconds of this host (fasthorovod::NowNs()); adding
// clock_offset_ns gives rank 0's clock (the worker estimates the offset, see capture.py).
//
// Cost on the hot path: Record() is a compare-and-swap on an index, a 104-byte copy into a
// preallocated ring and a release store. No syscall, no lock, no allocation. If the flusher falls
// behind by `capacity` records, Record() drops the record and counts it (metadata "dropped").
//
// API for the data plane (the proxy owns one recorder per lane and passes a pointer down):
//
//   TraceRecorder trace;                               // one per proxy process (lane)
//   trace.Open(options);                              // or Open(dir, rank, lane, clock_offset_ns)
//   int64_t id = trace.Record(record);                 // per frame; returns the record id, or
//                                                      //   kNoRecord when closed or dropped
//   trace.Close();                                     // flushes, finalizes metadata; idempotent
//
// Open/Close must not run concurrently with Record (the proxy calls all three from its own loop);
// Record itself may be called from several threads at once.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"

namespace fasthorovod {

enum class TraceDirection : uint8_t { kSend = 0, kRecv = 1 };

// What the frame belongs to. Ring steps t < size−1 of an allreduce are its reduce-scatter, the
// rest its allgather; the reader derives the phase from `step` and the file's `size`.
enum class TraceOp : uint8_t { kAllreduce = 1, kAllgather = 2, kAbort = 3, kReducescatter = 4 };

// Why the frame could not move earlier (SketchDLC's dep_type adapted to a ring):
enum class TraceDep : uint8_t {
  kNone = 0,        // independent (e.g. an abort frame)
  kOnRequest = 1,   // a step-0 send: waited for the worker's request (dep_id = kNoRecord)
  kOnReceive = 2,   // a send of segment i at step t+1: waited for the receive of segment i at step t
                    //   (dep_id = that receive's id, same file; dependency time = ready_ns − its end_ns)
  kOnPeerSend = 3,  // a receive: waited for the previous rank's send of the same (seq, step, segment);
                    //   that record is in another rank's file, so dep_id = kNoRecord and the reader
                    //   matches it by key
};

constexpr int64_t kNoRecord = -1;
constexpr uint64_t kNoRequest = ~uint64_t{0};  // a collective with no local request (joined rank)
constexpr uint8_t kTraceFlagZeroFill = 1;      // this rank took part with zeros (hvd.join)
constexpr uint32_t kTraceFormatVersion = 1;
constexpr size_t kTraceHeaderBytes = 4096;

// One frame. Plain data: the layout is the file format (static_assert below).
struct MessageRecord {
  uint64_t id = 0;              // record number in this file (assigned by Record)
  int64_t dep_id = kNoRecord;   // id of the record this one waited for (same file), or kNoRecord
  uint64_t seq = 0;             // collective number on this lane (CollectiveDesc::seq: equal on every rank)
  uint64_t request = kNoRequest;  // the worker's request number (RequestSlot::seq = Python Request.seq)
  uint64_t name_hash = 0;       // CollectiveDesc::name_hash
  uint64_t bytes = 0;           // payload bytes of this frame; the 128-byte frame header is NOT counted
  uint64_t shard_bytes = 0;     // bytes of this lane's shard of the collective
  int64_t ready_ns = 0;         // send: when the frame was queued (its dependency met); recv: = start_ns
  int64_t start_ns = 0;         // first byte written (send) / read (recv)
  int64_t end_ns = 0;           // last byte written (send) / read (recv; before any reduction)
  uint32_t src = 0;             // sending rank
  uint32_t dst = 0;             // receiving rank
  uint32_t step = 0;            // ring step, 0 … 2·(size−1)−1
  uint32_t segment = 0;         // segment index within the step's chunk
  uint16_t lane = 0;
  uint16_t socket = 0;          // socket index within the lane (a frame takes the first socket free)
  uint8_t direction = 0;        // TraceDirection
  uint8_t op = 1;               // TraceOp
  uint8_t dep_type = 0;         // TraceDep
  uint8_t flags = 0;            // kTraceFlag*
};
static_assert(sizeof(MessageRecord) == 104, "MessageRecord is the trace file format");
static_assert(offsetof(MessageRecord, src) == 80 && offsetof(MessageRecord, lane) == 96,
              "MessageRecord is the trace file format");

struct TraceOptions {
  std::string dir;                // created if missing (one level)
  uint32_t rank = 0;
  uint32_t size = 1;              // ranks in the ring (the reader needs it for the phase of a step)
  uint32_t lane = 0;
  int64_t clock_offset_ns = 0;    // add to local CLOCK_MONOTONIC ns to get rank 0's clock
  size_t capacity = 1 << 16;      // records buffered before the flusher must have caught up (power of 2)
  int flush_interval_ms = 20;     // how often the background thread writes
  std::string extra_json;         // more metadata: `"key": value, ...` pairs (no braces), or empty
};

class TraceRecorder {
 public:
  TraceRecorder() = default;
  ~TraceRecorder();
  TraceRecorder(const TraceRecorder&) = delete;
  TraceRecorder& operator=(const TraceRecorder&) = delete;

  // Creates the file, writes its metadata and starts the flusher. Closes a previous file first.
  Status Open(const TraceOptions& options);
  Status Open(const std::string& dir, uint32_t rank, uint32_t lane, int64_t clock_offset_ns);

  // Appends one record (its `id` is overwritten) and returns the id, or kNoRecord when the
  // recorder is not open or the buffer is full (counted in dropped()). Hot path: see top.
  int64_t Record(const MessageRecord& record);

  // Stops the flusher, writes every buffered record and the final metadata, closes the file.
  // Returns the first write error seen since Open. Safe to call when not open.
  Status Close();

  bool active() const { return active_.load(std::memory_order_relaxed); }
  uint64_t recorded() const { return next_.load(std::memory_order_acquire); }
  uint64_t dropped() const { return dropped_.load(std::memory_order_relaxed); }
  const std::string& path() const { return path_; }

 private:
  struct Slot {
    std::atomic<uint64_t> stamp{0};  // index + 1 once `record` holds record `index`
    MessageRecord record;
  };

  void FlushLoop();
  void Drain();  // flusher thread (or Close after it stopped): writes completed records in order
  std::string Metadata(bool closed) const;
  void WriteMetadata(bool closed);

  TraceOptions options_;
  std::string path_;
  std::string host_;
  int fd_ = -1;
  int64_t opened_ns_ = 0;
  int64_t closed_ns_ = 0;
  std::unique_ptr<Slot[]> slots_;
  size_t mask_ = 0;
  std::atomic<bool> active_{false};
  std::atomic<uint64_t> next_{0};     // next id to hand out
  std::atomic<uint64_t> flushed_{0};  // records [0, flushed_) are in the file; their slots are free
  std::atomic<uint64_t> dropped_{0};
  std::vector<MessageRecord> staging_;
  Status write_status_;
  std::thread flusher_;
  std::mutex mutex_;  // flusher sleep/wake only; never taken by Record
  std::condition_variable wake_;
  bool stop_ = false;
};

// "rank<R>.lane<J>.bin": the name a recorder uses unless it is taken.
std::string TraceFileName(uint32_t rank, uint32_t lane);

}  // namespace fasthorovod
