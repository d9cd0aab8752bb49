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

// Connects a ring of `size` ranks with `sockets` sockets per neighbour (size 1: invalid fds).
// buffer_bytes > 0 fixes the socket buffers (small buffers force frames onto several sockets).
inline std::vector<fasthorovod::RingLinks> ConnectRing(uint32_t size, int sockets, int buffer_bytes = 0) {
  using namespace fasthorovod;
  std::vector<RingLinks> links(size);
  if (size == 1) {
    links[0].to_next.emplace_back(-1);
    links[0].from_prev.emplace_back(-1);
    return links;
  }
  std::vector<Socket> listeners(size);
  std::vector<int> ports(size);
  for (uint32_t r = 0; r < size; ++r) CHECK(Listen("127.0.0.1", buffer_bytes, &listeners[r], &ports[r]).ok());
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      LinkIdentity self;
      std::memset(self.token, 7, kTokenBytes);
      self.rank = r;
      self.size = size;
      Status st = EstablishRing(self, listeners[r], {"127.0.0.1", ports[(r + 1) % size]}, sockets, buffer_bytes,
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
