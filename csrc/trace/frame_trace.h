// The trace as an observer of the lane transport: one MessageRecord per data frame (docs/trace.md).
//
// The lane (transport/lane.h) reports every frame it completes as a FrameEvent; this adapter adds
// what only the proxy knows — the worker's request number and flags such as a zero-filled join —
// and appends the record to a TraceRecorder. The lane hands the returned record id back as the
// dependency of the sends a receive releases, so dependency chains come out as before.
#pragma once

#include "transport/lane.h"
#include "trace/recorder.h"

namespace fasthorovod {

class TraceFrameObserver : public FrameObserver {
 public:
  explicit TraceFrameObserver(TraceRecorder* recorder) : recorder_(recorder) {}

  // Set before each collective: the worker's request number (kNoRequest: none) and kTraceFlag*.
  void SetCollective(uint64_t request, uint8_t flags) {
    request_ = request;
    flags_ = flags;
  }

  int64_t OnFrame(const CollectiveDesc& desc, const FrameEvent& event) override;

 private:
  TraceRecorder* recorder_;
  uint64_t request_ = kNoRequest;
  uint8_t flags_ = 0;
};

}  // namespace fasthorovod
