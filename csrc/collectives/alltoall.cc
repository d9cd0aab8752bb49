// The mesh alltoall's schedule (collectives/alltoall.h); the Lane moves and checks the frames.
#include "collectives/alltoall.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "common/clock.h"
#include "transport/lane.h"

namespace fasthorovod {
namespace {

size_t Align64(size_t x) { return (x + 63) & ~size_t{63}; }

// One step: the block for rank + d (sent) and the block from rank - d (received), in segments
// that this rank's lanes share. Each lane's step pulls the next unclaimed segment of the block it
// sends from the claim word they share (AlltoallWork::claimed) when one of its sockets can take it,
// so a lane whose flows drain faster carries more of the block; on the receiving side each lane
// takes what its peer lane sends, wherever in the block it lies.
class AlltoallStep : public FrameSource, public FrameSink {
 public:
  AlltoallStep(const AlltoallWork& work, uint32_t rank, uint32_t size, uint32_t distance, size_t segment_bytes)
      : distance_(distance), elem_(DTypeSize(work.dtype)),
        seg_(std::max<size_t>(1, std::min(segment_bytes, kMeshSegmentBytes) / elem_)) {
    const uint32_t dst = (rank + distance) % size, src = (rank + size - distance) % size;
    send_ = work.send + BlockBegin(work.send_count, dst) * elem_;
    send_elems_ = work.send_count[dst];
    recv_ = work.recv + BlockBegin(work.recv_count, src) * elem_;
    recv_elems_ = work.recv_count[src];
    claimed_ = work.claimed + dst;
    received_.assign(Segments(recv_elems_), false);
  }

  bool Next(Frame* f, const char** payload) override {
    const uint64_t i = __atomic_fetch_add(claimed_, 1, __ATOMIC_RELAXED);
    if (i >= Segments(send_elems_)) return false;
    f->step = distance_;
    f->segment = static_cast<uint32_t>(i);
    const size_t begin = i * seg_;
    f->offset = begin * elem_;
    f->length = (std::min(send_elems_, begin + seg_) - begin) * elem_;
    *payload = send_ + f->offset;
    return true;
  }

  Status Accept(const Frame& f, size_t, char** payload) override {
    const size_t begin = std::min(recv_elems_, size_t{f.segment} * seg_);
    const size_t end = std::min(recv_elems_, begin + seg_);
    if (f.step != distance_ || f.segment >= received_.size() || f.offset != begin * elem_ ||
        f.length != (end - begin) * elem_) {
      return Status::Error(Code::kIoError,
                           Str("alltoall frame of distance ", f.step, " segment ", f.segment, " with offset ", f.offset,
                               " and length ", f.length, " (this rank expects distance ", distance_, ", ",
                               received_.size(), " segments of ", seg_ * elem_, " bytes in its ", recv_elems_ * elem_,
                               " bytes)"));
    }
    if (received_[f.segment]) return Status::Error(Code::kIoError, Str("alltoall segment ", f.segment, " sent twice"));
    received_[f.segment] = true;
    *payload = recv_ + f.offset;
    return Status::Ok();
  }

  void Received(const Frame&, size_t) override {}

 private:
  size_t Segments(size_t elems) const { return (elems + seg_ - 1) / seg_; }

  // Where block `rank` begins in a region laid out by `counts` (elements).
  static size_t BlockBegin(const std::vector<uint64_t>& counts, uint32_t rank) {
    size_t at = 0;
    for (uint32_t r = 0; r < rank; ++r) at += counts[r];
    return at;
  }

  const uint32_t distance_;
  const size_t elem_;
  const size_t seg_;  // elements per segment
  size_t send_elems_ = 0, recv_elems_ = 0;
  const char* send_ = nullptr;
  char* recv_ = nullptr;
  uint64_t* claimed_ = nullptr;
  std::vector<bool> received_;  // by this lane
};

LaneOptions StepOptions(const RingOptions& options, uint32_t distance) {
  LaneOptions o = options;
  o.distance = distance;
  o.socket_counters = nullptr;  // the rings' sockets, not these
  o.rehash_out = 0;
  o.unsent_low_water = static_cast<int>(kMeshSegmentBytes);
  const uint32_t n = options.size;
  o.prev_name = Str("rank ", (options.rank + n - distance) % n, " lane ", options.lane, " (mesh)");
  o.next_name = Str("rank ", (options.rank + distance) % n, " lane ", options.lane, " (mesh)");
  return o;
}

// The send gate of the step of distance `distance` (LaneOptions::send_gate): open once the worker
// has staged that many blocks (AlltoallWork::staged); an error once it says it cannot, or when it
// has not within the lane's timeout.
std::function<Status(bool*)> StagedGate(const uint64_t* staged, uint32_t distance, const RingOptions& options) {
  const Deadline deadline = Deadline::After(options.timeout_seconds);
  return [staged, distance, deadline, rank = options.rank, blocks = options.size - 1,
          timeout = options.timeout_seconds](bool* open) {
    const uint64_t now = __atomic_load_n(staged, __ATOMIC_ACQUIRE);
    if (now == kAlltoallStagingFailed) {
      return Status::Error(Code::kAborted, Str("rank ", rank, "'s worker could not stage its alltoall rows"));
    }
    *open = now >= distance;
    if (!*open && deadline.Expired()) {
      return Status::Error(Code::kTimeout,
                           Str("rank ", rank, "'s worker staged ", now, " of its ", blocks, " alltoall blocks in ", timeout, " s"));
    }
    return Status::Ok();
  };
}

// The steps run at once, one thread each, and a trace records frames from one thread at a time.
class SerialObserver : public FrameObserver {
 public:
  explicit SerialObserver(FrameObserver* inner) : inner_(inner) {}
  int64_t OnFrame(const CollectiveDesc& desc, const FrameEvent& event) override {
    std::lock_guard<std::mutex> lock(mu_);
    return inner_->OnFrame(desc, event);
  }

 private:
  FrameObserver* inner_;
  std::mutex mu_;
};

// What the steps share: the first failure (the cause every step's lane then aborts with) and the
// counts.
class Steps {
 public:
  explicit Steps(const RingOptions& options) : options_(options) {}

  // Whether the job's abort flag is up; if so, the steps stop with its reason.
  void Watch() {
    if (options_.abort == nullptr || options_.abort->load(std::memory_order_acquire) == 0) return;
    const bool known = options_.abort_reason != nullptr && options_.abort_reason[0] != '\0';
    const Code code = options_.abort_code != nullptr ? CodeFromWire(*options_.abort_code) : Code::kAborted;
    Fail(Status::Error(code, known ? options_.abort_reason : "the job is shutting down"));
  }

  void Fail(const Status& st) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!first_.ok()) return;
    first_ = st;
    const std::string& m = st.message();
    m.copy(reason_, std::min(m.size(), sizeof(reason_) - 1));
    code_ = static_cast<uint32_t>(st.code());
    stop_.store(1, std::memory_order_release);  // after the reason: a lane reads it once it sees the flag
  }

  LaneOptions For(uint32_t distance, FrameObserver* observer) {
    LaneOptions o = StepOptions(options_, distance);
    o.abort = &stop_;
    o.abort_reason = reason_;
    o.abort_code = &code_;
    o.observer = observer;
    return o;
  }

  void Add(const LaneStats& s) {
    std::lock_guard<std::mutex> lock(mu_);
    totals_.bytes_sent += s.bytes_sent;
    totals_.bytes_received += s.bytes_received;
    totals_.frames_sent += s.frames_sent;
    totals_.frames_received += s.frames_received;
  }

  Status first() const { return first_; }
  const LaneStats& totals() const { return totals_; }

 private:
  const RingOptions& options_;
  std::mutex mu_;
  Status first_;
  char reason_[kMaxAbortMessage] = {};  // written once, before stop_
  uint32_t code_ = 0;
  std::atomic<uint32_t> stop_{0};
  LaneStats totals_;
};

}  // namespace

size_t AlltoallTableWords(uint32_t n) { return 3 * size_t{n} + 3; }

size_t AlltoallClaimWord(uint32_t n) { return 2 * size_t{n} + 3; }

size_t AlltoallStagedWord(uint32_t n) { return 2 * size_t{n} + 2; }

size_t AlltoallSendOffset(uint32_t n) { return Align64(sizeof(uint64_t) * AlltoallTableWords(n)); }

Status MeshAlltoall(std::vector<RingLinks>& by_distance, const CollectiveDesc& desc, const AlltoallWork& work,
                    const RingOptions& options, RingStats* stats) {
  const uint32_t n = options.size;
  stats->start_ns = NowNs();
  if (by_distance.size() != n || work.send_count.size() != n || work.recv_count.size() != n ||
      work.lane >= work.lanes || work.claimed == nullptr) {
    return Status::Error(Code::kInvalidArgument, "the alltoall's mesh or size table does not match the ranks");
  }
  std::unique_ptr<SerialObserver> observer;
  if (options.observer != nullptr) observer = std::make_unique<SerialObserver>(options.observer);
  Steps steps(options);
  std::atomic<uint32_t> next{0};
  std::mutex mu;
  std::condition_variable done;
  uint32_t running = std::min(n - 1, kMaxConcurrentSteps);
  auto run_steps = [&] {
    for (uint32_t i = next.fetch_add(1); i + 1 < n; i = next.fetch_add(1)) {
      const uint32_t d = (work.lane + i) % (n - 1) + 1;
      AlltoallStep step(work, options.rank, n, d, options.segment_bytes);
      LaneOptions lane_options = steps.For(d, observer.get());
      if (work.staged != nullptr) lane_options.send_gate = StagedGate(work.staged, d, options);
      Lane lane(by_distance[d], lane_options);
      lane.Begin(desc, kFramesUnknown, kFramesUnknown);
      lane.Pull(&step);  // not before the gate opens: the block is staged
      LaneStats lane_stats;
      Status st = lane.Run(&step, &lane_stats);  // once a step failed, the others abort at once
      steps.Add(lane_stats);
      if (!st.ok()) steps.Fail(st);
    }
    std::lock_guard<std::mutex> lock(mu);
    if (--running == 0) done.notify_all();
  };
  steps.Watch();  // an abort raised already: every step fails at once, telling its peer
  std::vector<std::thread> pool;
  for (uint32_t t = 0, threads = running; t < threads; ++t) pool.emplace_back(run_steps);
  {
    std::unique_lock<std::mutex> lock(mu);
    // The job's abort flag reaches the steps through their own (Steps::Watch), within 50 ms.
    while (!done.wait_for(lock, std::chrono::milliseconds(50), [&] { return running == 0; })) {
      lock.unlock();
      steps.Watch();
      lock.lock();
    }
  }
  for (auto& t : pool) t.join();
  stats->bytes_sent = steps.totals().bytes_sent;
  stats->bytes_received = steps.totals().bytes_received;
  stats->frames_sent = steps.totals().frames_sent;
  stats->frames_received = steps.totals().frames_received;
  stats->end_ns = NowNs();
  return steps.first();
}

}  // namespace fasthorovod
