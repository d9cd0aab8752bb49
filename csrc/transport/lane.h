// The lane transport: frames of one collective between this rank and its two ring neighbours.
//
// A lane is one ring: this rank receives only from the previous rank and sends only to the next,
// each over S sockets (RingLinks, set up by socket.h). The lane moves frames; what the frames
// mean — which chunk, which step, what to reduce — belongs to the collective (collectives/ring.cc)
// that drives it through a small interface, the way Gloo splits transport from algorithm:
//
//   Lane lane(links, options);
//   lane.Begin(desc, frames_out, frames_in);    // one collective: how many frames go each way
//   lane.Send(frame, payload);                   // queue the first frames
//   lane.Run(&sink, &stats);                     // move bytes until everything went both ways;
//     sink.Accept(frame, socket, &dst)           //   a header arrived: check it, say where its payload goes
//     sink.Received(frame, socket)               //   its payload is complete: reduce, Send what it releases
//
// Framing. Each frame is a 128-byte FrameHeader (lane.cc) and its payload. The header embeds the
// sender's CollectiveDesc, and the receiver compares it with its own (SameCollective): a
// difference means the ranks issued different collectives and fails the lane with a message
// naming both ranks and both tensors (Code::kMismatch). Payloads are never copied by the lane: a
// frame is written from the collective's buffer with one sendmsg of two iovecs (header, payload)
// and read straight into the destination the sink names.
//
// Striping. Frames ready to go wait in one queue, in the order queued, and each goes out on the
// socket with the least left to send (unsent bytes in the kernel and in its frame in progress), so
// a step's frames spread over the S sockets and a socket whose flow is slower (an unlucky share of
// a shaped link) carries fewer frames instead of holding the collective back. Once its last
// frame is out, the sender closes the collective on every socket with an end marker (a header
// without payload, carrying how many data frames went on that socket), so each receiver knows when
// a socket's frames of this collective are over, never reads into the next collective's, and
// checks that none was lost. Every poll round receives before it sends.
//
// Pulling. A collective whose frames are not known in advance (Begin with kFramesUnknown) hands
// the lane a FrameSource instead of queueing: a send socket asks it for one frame when it has
// none in progress and its kernel buffer is nearly drained (TCP_NOTSENT_LOWAT, set to
// LaneOptions::unsent_low_water, makes poll report the socket writable only then), so a frame is
// claimed just before the socket can carry it. Several lanes pulling from one shared source (the
// alltoall's blocks, collectives/alltoall.h) thus share its frames in proportion to how fast
// each drains, to the last frame. The receiver, told kFramesUnknown too, takes frames until every
// socket's end marker, checking each socket's count against its marker.
//
// Re-hashing. A flow that shares a per-flow cap with another (their ports hashed alike) drains
// slower than its siblings; the sender can replace it by a new connection, whose new source port
// hashes anew. It marks the socket in LaneOptions::rehash_out: that socket's end marker of the
// collective says so, the receiver reports it in LaneStats::rehash_in, and after the collective
// both sides swap the connection (ReplaceRingSockets, socket.h) before the next one starts, so no
// frame is lost or reordered: every frame of the collective went over the old connection, every
// frame of the next goes over the new one.
//
// Failure. Every wait is bounded: if no byte moves for `timeout_seconds`, the lane fails naming
// the neighbour it was waiting for (Code::kTimeout). The abort flag is polled every round (at most
// 100 ms). A rank whose lane fails sends an abort frame on every socket to the next rank carrying
// the message, the origin rank and the origin's Code; the next rank fails with that code and
// message and forwards it, so every rank of the ring reports the same cause with the same code (a
// mismatch is kMismatch everywhere, a timeout kTimeout), instead of a bare EOF.
//
// Tracing. If a FrameObserver is set, the lane reports every data frame sent or received (never
// end markers or abort frames) with its times, socket and dependency; the trace recorder adapts
// these to records (trace/frame_trace.h). Without one the lane reads no clock for it.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "common/collective.h"
#include "common/status.h"
#include "transport/socket.h"

namespace fasthorovod {

constexpr size_t kFrameHeaderBytes = 128;
constexpr size_t kMaxAbortMessage = 4096;
constexpr uint64_t kFramesUnknown = ~uint64_t{0};  // Lane::Begin: counted as they come (Pulling)

// A data frame as the collective sees it: its place in the schedule and its payload bytes.
struct Frame {
  uint32_t step = 0;
  uint32_t segment = 0;
  uint64_t offset = 0;  // bytes into the shard
  uint64_t length = 0;  // payload bytes
};

// Why a frame could not move earlier (values match TraceDep, trace/recorder.h).
enum class FrameDep : uint8_t {
  kOnRequest = 1,   // sent: queued before the lane ran (waited for the collective to start)
  kOnReceive = 2,   // sent: released by the receive with record id dep_id
  kOnPeerSend = 3,  // received: waited for the previous rank's send of the same frame
};

// One data frame that has been completely sent or received.
struct FrameEvent {
  bool send = true;      // false: received
  uint32_t src = 0;      // sending rank
  uint32_t dst = 0;      // receiving rank
  uint32_t lane = 0;
  size_t socket = 0;     // socket index within the lane
  Frame frame;
  int64_t ready_ns = 0;  // send: queued; receive: = start_ns
  int64_t start_ns = 0;  // first byte written / read
  int64_t end_ns = 0;    // last byte written / read (a receive: before the sink consumed it)
  FrameDep dep = FrameDep::kOnRequest;
  int64_t dep_id = -1;   // the observer's id of the frame depended on, or -1
};

// Frames that a collective hands out one at a time, as the lane's sockets can take them (Pulling).
class FrameSource {
 public:
  virtual ~FrameSource() = default;
  // The next frame to send and its payload (valid until Run returns), or false once there is none
  // left (then never asked again in this collective).
  virtual bool Next(Frame* frame, const char** payload) = 0;
};

class FrameObserver {
 public:
  virtual ~FrameObserver() = default;
  // Returns an id for the frame (handed back as dep_id of the sends it releases), or -1.
  virtual int64_t OnFrame(const CollectiveDesc& desc, const FrameEvent& event) = 0;
};

// What the collective does with received frames.
class FrameSink {
 public:
  virtual ~FrameSink() = default;
  // A data frame's header arrived on `socket`: check it against the schedule and set *payload to
  // where its frame.length bytes go (valid until Received). An error fails the lane.
  virtual Status Accept(const Frame& frame, size_t socket, char** payload) = 0;
  // Its payload is complete: consume it and queue, with Lane::Send, the frames it releases.
  virtual void Received(const Frame& frame, size_t socket) = 0;
};

// One send socket's pace, for finding flows slower than their siblings (hashed onto a shared
// per-flow cap): bytes written, and the time the socket had bytes the kernel had not sent yet
// (SIOCOUTQNSD > 0 at the start of a poll round: the flow, not this rank, was the limit). Their
// ratio is the rate the flow drains at, whatever the other hops of the ring do.
struct SocketCounters {
  std::atomic<uint64_t> bytes_sent{0};
  std::atomic<uint64_t> backlogged_ns{0};
};

struct LaneOptions {
  uint32_t rank = 0;
  uint32_t size = 1;
  uint32_t lane = 0;
  double timeout_seconds = 300.0;                 // longest time without any byte moving
  const std::atomic<uint32_t>* abort = nullptr;  // polled; non-zero makes the collective fail
  const char* abort_reason = nullptr;             // why, once `abort` is set (may be null)
  const uint32_t* abort_code = nullptr;           // its Code (null: kAborted)
  std::atomic<int64_t>* progress_ns = nullptr;    // if set, stamped whenever bytes move
  // If set, one SocketCounters per send socket, added to as bytes go out (cumulative, read by the
  // worker's re-hashing policy while the lane runs).
  SocketCounters* socket_counters = nullptr;
  // Send sockets (bit s: socket s) whose end marker of this collective announces that the sender
  // replaces the connection after it (Rehash below); the receiver learns it from the marker.
  uint64_t rehash_out = 0;
  FrameObserver* observer = nullptr;              // if set, told about every data frame
  // If set, the lane sends nothing (not even its end marker) until the gate says open, asking it
  // every millisecond meanwhile while it receives; an error from it fails the lane. For payloads
  // the worker is still writing (the alltoall's staging, collectives/alltoall.h).
  std::function<Status(bool* open)> send_gate;
  // With a FrameSource: TCP_NOTSENT_LOWAT of the send sockets (bytes), so that a socket asks for
  // its next frame only once it has less than this left to send (0: the kernel's default).
  int unsent_low_water = 0;
  // The ring's stride: this rank sends to rank + distance and receives from rank - distance (1: the
  // lanes' rings; d: the mesh's links of distance d, collectives/alltoall.h).
  uint32_t distance = 1;
  std::string prev_name;  // "rank 0 (10.0.0.1:4242)" for messages
  std::string next_name;
};

// Per-collective counts (payload and data-frame headers; end markers and aborts not counted).
struct LaneStats {
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t frames_sent = 0;
  uint64_t frames_received = 0;
  uint64_t rehash_in = 0;  // receive sockets (bit s) whose end marker announced a replacement
};

class Lane {
 public:
  // `links` must have the same number (>= 1) of sockets each way and outlive the lane; the options
  // are copied.
  Lane(RingLinks& links, const LaneOptions& options);
  ~Lane();
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;

  // Starts a collective in which this rank sends `frames_out` data frames and receives `frames_in`;
  // either may be kFramesUnknown (Pulling): frames_out then comes from the FrameSource given to
  // Pull, frames_in from the end markers. `desc` must outlive Run.
  void Begin(const CollectiveDesc& desc, uint64_t frames_out, uint64_t frames_in);

  // Where the frames of a collective begun with frames_out = kFramesUnknown come from; must
  // outlive Run.
  void Pull(FrameSource* source);

  // Queues a data frame (before Run, or from FrameSink::Received). `payload` must stay valid and
  // unchanged until the frame is out (at the latest until Run returns).
  void Send(const Frame& frame, const char* payload);

  // Moves frames until every frame and end marker of the collective went both ways. On failure the
  // lane is unusable: it has sent an abort frame (unless the failure came from the next rank) and
  // returns why.
  Status Run(FrameSink* sink, LaneStats* stats);

 private:
  class Impl;
  Impl* impl_;
};


// Reads and discards what the previous rank is still sending, for as long as it keeps coming (at
// most `seconds`). Call before closing a failed lane: closing a socket with unread bytes makes the
// kernel send a reset, which can destroy data the peer has not read yet — such as the abort frame
// this lane just sent to explain the failure.
void DrainIncoming(RingLinks& links, double seconds);

}  // namespace fasthorovod
