// Ranks as threads over loopback TCP, connected exactly as proxies connect (socket.h handshakes).
#pragma once

#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "harness.h"
#include "transport/lane.h"
#include "transport/socket.h"

namespace fhtest {

// What each rank of a loopback ring connects with; kept by tests that connect again (re-hashing).
struct RingSetup {
  std::vector<fasthorovod::Socket> listeners, alt_listeners;  // each rank's two ring ports, as a proxy's
  std::vector<int> ports, alt_ports;
  fasthorovod::RingListeners Listeners(uint32_t rank) const { return {listeners[rank], alt_listeners[rank]}; }
  fasthorovod::LinkIdentity Identity(uint32_t rank) const {
    fasthorovod::LinkIdentity self;
    std::memset(self.token, 7, fasthorovod::kTokenBytes);
    self.rank = rank;
    self.size = static_cast<uint32_t>(ports.size());
    return self;
  }
  fasthorovod::RingEndpoint Next(uint32_t rank) const {
    const size_t next = (rank + 1) % ports.size();
    return {"127.0.0.1", {ports[next], alt_ports[next]}};
  }
};

// Connects a ring of `size` ranks with `sockets` sockets per neighbour (size 1: invalid fds).
// buffer_bytes > 0 fixes the socket buffers (small buffers force frames onto several sockets).
// `setup`, if given, keeps the listeners open and says how to reach them.
inline std::vector<fasthorovod::RingLinks> ConnectRing(uint32_t size, int sockets, int buffer_bytes = 0,
                                                       RingSetup* setup = nullptr) {
  using namespace fasthorovod;
  std::vector<RingLinks> links(size);
  if (size == 1) {
    links[0].to_next.emplace_back(-1);
    links[0].from_prev.emplace_back(-1);
    return links;
  }
  RingSetup local;
  RingSetup& ring = setup != nullptr ? *setup : local;
  ring.listeners.resize(size);
  ring.alt_listeners.resize(size);
  ring.ports.resize(size);
  ring.alt_ports.resize(size);
  for (uint32_t r = 0; r < size; ++r) {
    CHECK(Listen("127.0.0.1", buffer_bytes, &ring.listeners[r], &ring.ports[r]).ok());
    CHECK(Listen("127.0.0.1", buffer_bytes, &ring.alt_listeners[r], &ring.alt_ports[r]).ok());
  }
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      Status st = EstablishRing(ring.Identity(r), ring.Listeners(r), ring.Next(r), sockets, buffer_bytes,
                                Deadline::After(10.0), &links[r]);
      CHECK(st.ok());
    });
  }
  for (auto& t : threads) t.join();
  return links;
}

// Runs fn(rank) on one thread per rank and waits for all.
inline void RunRanks(uint32_t size, const std::function<void(uint32_t)>& fn) {
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < size; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

inline fasthorovod::LaneOptions Options(uint32_t rank, uint32_t size, double timeout_seconds = 10.0) {
  fasthorovod::LaneOptions o;
  o.rank = rank;
  o.size = size;
  o.timeout_seconds = timeout_seconds;
  o.prev_name = fasthorovod::Str("rank ", (rank + size - 1) % size);
  o.next_name = fasthorovod::Str("rank ", (rank + 1) % size);
  return o;
}

}  // namespace fhtest
