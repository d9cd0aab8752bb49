// The authenticated handshake (socket.h): a peer without the job token is refused and told
// nothing; an authenticated peer with another configuration is told why.
#include <sys/socket.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"
#include "transport/socket.h"

using namespace fasthorovod;

namespace {

LinkIdentity Identity(uint32_t rank, uint32_t size, char token_byte, uint64_t config_hash = 0) {
  LinkIdentity id;
  std::memset(id.token, token_byte, kTokenBytes);
  id.rank = rank;
  id.size = size;
  id.config_hash = config_hash;
  return id;
}

// Runs EstablishRing for every identity at once (a ring of ids.size() ranks), rank r connecting for
// purposes[r] (default: the ring); returns each status.
std::vector<Status> Establish(const std::vector<LinkIdentity>& ids, double seconds,
                              std::vector<LinkPurpose> purposes = {}, std::vector<int64_t>* elapsed_ns = nullptr) {
  purposes.resize(ids.size(), LinkPurpose::kRing);
  const uint32_t size = static_cast<uint32_t>(ids.size());
  std::vector<Socket> listeners(size);
  std::vector<int> ports(size);
  for (uint32_t r = 0; r < size; ++r) CHECK(Listen("127.0.0.1", 0, &listeners[r], &ports[r]).ok());
  std::vector<Status> results(size);
  std::vector<int64_t> elapsed(size);
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      RingLinks links;
      const int64_t start = NowNs();
      results[r] = EstablishRing(ids[r], listeners[r], {"127.0.0.1", {ports[(r + 1) % size]}}, 1, 0,
                                 Deadline::After(seconds), &links, purposes[r]);
      elapsed[r] = NowNs() - start;
    });
  }
  for (auto& t : threads) t.join();
  if (elapsed_ns != nullptr) *elapsed_ns = elapsed;
  return results;
}

bool Contains(const Status& st, const char* what) { return st.message().find(what) != std::string::npos; }

}  // namespace

// Both ranks connect to each other; whichever is refused first stops accepting, so the other may
// fail for that reason instead (its peer gave up) or at the deadline: which one is the scheduler's
// choice. What must hold: every rank fails, a refused rank fails at once with the refusal, and no
// rank learns the acceptor's reason.
TEST(HandshakeRefusesAPeerWithAnotherTokenWithoutAReason) {
  std::vector<int64_t> elapsed;
  auto results = Establish({Identity(0, 2, 7), Identity(1, 2, 9)}, 5.0, {}, &elapsed);
  for (size_t r = 0; r < results.size(); ++r) {
    const Status& st = results[r];
    CHECK(!st.ok());
    CHECK(!Contains(st, "token differs"));  // the server's reason stays on the server
    if (Contains(st, "did not accept this connection's proof of the job token")) {
      CHECK(elapsed[r] < 4'000'000'000);  // a refusal ends set-up; it does not wait for the deadline
    }
  }
  CHECK(Contains(results[0], "did not accept this connection's proof of the job token") ||
        Contains(results[1], "did not accept this connection's proof of the job token"));
}

TEST(HandshakeTellsAnAuthenticatedPeerThatItsConfigurationDiffers) {
  auto results = Establish({Identity(0, 2, 7, 1), Identity(1, 2, 7, 2)}, 5.0);
  for (const Status& st : results) CHECK(!st.ok());
  const char* reason = "configuration differs (FASTHOROVOD_* settings must be equal on every rank)";
  CHECK(Contains(results[0], reason) || Contains(results[1], reason));
}

TEST(HandshakeKeepsProbeAndRingConnectionsApart) {
  auto results = Establish({Identity(0, 2, 7), Identity(1, 2, 7)}, 5.0, {LinkPurpose::kProbe, LinkPurpose::kRing});
  for (const Status& st : results) CHECK(!st.ok());
  CHECK(Contains(results[0], "not a ring connection") || Contains(results[1], "not a probe connection"));
  auto probes = Establish({Identity(0, 2, 7), Identity(1, 2, 7)}, 5.0, {LinkPurpose::kProbe, LinkPurpose::kProbe});
  for (const Status& st : probes) CHECK(st.ok());
}

TEST(HandshakeGivesAStrangerNoAckAndNoReason) {
  Socket listener;
  int port = 0;
  CHECK(Listen("127.0.0.1", 0, &listener, &port).ok());
  const LinkIdentity server = Identity(0, 2, 7);
  std::thread stranger_thread;
  std::string received;
  bool closed = false;
  stranger_thread = std::thread([&] {
    Socket sock;
    CHECK(ConnectWithRetry("127.0.0.1", port, Deadline::After(5), &sock).ok());
    // A well-formed Hello from "rank 1", then a proof made up without the token.
    const std::string hello = EncodeHello(Identity(1, 2, 0), 0);
    CHECK(SendAll(sock.fd(), hello.data(), hello.size(), Deadline::After(2), "rank 0").ok());
    char challenge[24];
    CHECK(RecvAll(sock.fd(), challenge, sizeof(challenge), Deadline::After(2), "rank 0").ok());
    const std::string forged(32, '\x5a');
    CHECK(SendAll(sock.fd(), forged.data(), forged.size(), Deadline::After(2), "rank 0").ok());
    char buf[256];
    Deadline deadline = Deadline::After(3);
    while (!deadline.Expired()) {
      ssize_t n = ::recv(sock.fd(), buf, sizeof(buf), 0);
      if (n > 0) received.append(buf, static_cast<size_t>(n));
      if (n == 0) {
        closed = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  HandshakeAcceptor acceptor(listener, server.token, 0, "test server");
  int taken = 0;
  Deadline until = Deadline::After(3);
  while (!until.Expired() && !closed) {
    CHECK(acceptor.Step(50, [](const PeerClaim&) { return std::string(); },
                        [&](const PeerClaim&, Socket) { ++taken; })
              .ok());
  }
  stranger_thread.join();
  CHECK_EQ(taken, 0);
  CHECK(closed);
  CHECK_EQ(received.size(), 0u);  // no Ack, no reason: just a closed connection
}

TEST(HandshakeProgressesManyPendingConnectionsAtOnce) {
  Socket listener;
  int port = 0;
  CHECK(Listen("127.0.0.1", 0, &listener, &port).ok());
  std::vector<Socket> silent(30);  // say nothing at all
  for (auto& s : silent) CHECK(ConnectWithRetry("127.0.0.1", port, Deadline::After(5), &s).ok());
  const LinkIdentity server = Identity(0, 2, 7), client = Identity(1, 2, 7);
  Status client_status = Status::Error(Code::kTimeout, "not run");
  std::thread client_thread([&] {
    Socket sock;
    CHECK(ConnectWithRetry("127.0.0.1", port, Deadline::After(5), &sock).ok());
    client_status = AuthenticateToPeer(sock.fd(), client, LinkPurpose::kRing, 0, 0, Deadline::After(5), "rank 0");
  });
  HandshakeAcceptor acceptor(listener, server.token, 0, "test server");
  const int64_t start = NowNs();
  int taken = 0;
  while (taken == 0 && NowNs() - start < 5'000'000'000) {
    CHECK(acceptor.Step(50, [](const PeerClaim&) { return std::string(); },
                        [&](const PeerClaim& claim, Socket) {
                          CHECK_EQ(claim.rank, 1u);
                          ++taken;
                        })
              .ok());
  }
  client_thread.join();
  CHECK_EQ(taken, 1);
  CHECK(client_status.ok());
  CHECK(NowNs() - start < 1'000'000'000);  // not 30 × 2 s
}
