// Shared-memory segments (anonymous memfds with reserved pages), their hand-over on a socket pair,
// the host segment of the hierarchical allreduce (opened and shared through /proc),
// and the process watches of proxy/watch.h: reaping at once, killing after a grace period, the
// worker's death seen whatever thread spawned the proxy, with and without pidfds.
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "common/clock.h"
#include "harness.h"
#include "testing/no_pidfd.h"
#include "proxy/watch.h"
#include "shm/handoff.h"
#include "shm/host.h"
#include "shm/segment.h"

using namespace fasthorovod;

namespace {

double Since(int64_t start_ns) { return static_cast<double>(NowNs() - start_ns) / 1e9; }

std::string FdTarget(int fd) {
  char buf[256] = {};
  const std::string link = "/proc/self/fd/" + std::to_string(fd);
  ssize_t n = readlink(link.c_str(), buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

bool Reaped(int pid) { return waitpid(pid, nullptr, WNOHANG) < 0 && errno == ECHILD; }

int SleepingChild() {
  int pid = fork();
  if (pid == 0) {
    for (;;) pause();
  }
  return pid;
}

// Waits up to `seconds` for cond().
template <typename F>
bool Within(double seconds, F cond) {
  const int64_t start = NowNs();
  while (!cond()) {
    if (Since(start) > seconds) return false;
    usleep(2000);
  }
  return true;
}

// The watch's own checks, for use in a child process: 0 if all passed, else the failed step.
int ChildWatchSteps(bool expect_pidfds) {
  ChildWatch watch;
  const int killed = SleepingChild();
  const int stopped = SleepingChild();
  if (!watch.Add(0, killed).ok() || !watch.Add(1, stopped).ok()) return 1;
  if (watch.uses_pidfds() != expect_pidfds) return 2;
  kill(killed, SIGKILL);
  // Reaped by the watch's thread without anyone asking: no zombie, within a second.
  if (!Within(1.0, [&] { return watch.Exited(0); })) return 3;
  if (!Reaped(killed)) return 4;
  int code = 0;
  if (!watch.ExitCode(0, &code) || code != -SIGKILL) return 5;
  std::string how;
  if (watch.FirstExited(0, &how) != 0 || how.find("killed by signal 9") == std::string::npos) return 6;
  // A stopped child does not exit on its own: killed after the grace period, then reaped.
  kill(stopped, SIGSTOP);
  const int64_t start = NowNs();
  watch.Terminate(0.2);
  if (!watch.Exited(1) || !Reaped(stopped) || Since(start) > 1.0) return 7;
  return 0;
}

}  // namespace

TEST(SegmentsAreAnonymousZeroedAndSharedThroughTheirDescriptor) {
  ShmSegment seg;
  Status st = ShmSegment::Create(1 << 20, "a test buffer", &seg);
  CHECK(st.ok());
  if (!st.ok()) return;
  CHECK_EQ(seg.size(), size_t{1} << 20);
  CHECK(FdTarget(seg.fd()).rfind("/memfd:fasthorovod", 0) == 0);  // no name in any file system
  CHECK_EQ(static_cast<const char*>(seg.data())[(1 << 20) - 1], 0);

  int pair[2];
  CHECK_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair), 0);
  CHECK(SendSegment(pair[0], 7, seg.size(), seg.fd(), Deadline::After(1.0)).ok());
  seg.CloseFd();
  SegmentGrant grant;
  CHECK(ReceiveSegment(pair[1], 1000, &grant).ok());
  CHECK_EQ(grant.id, 7u);
  CHECK_EQ(grant.bytes, uint64_t{1} << 20);
  ShmSegment other;
  CHECK(ShmSegment::Map(grant.fd, grant.bytes, "the received buffer", &other).ok());
  static_cast<char*>(seg.data())[12345] = 42;  // two mappings of one memory
  CHECK_EQ(static_cast<char*>(other.data())[12345], 42);
  CHECK_EQ(other.fd(), -1);  // the mapping is all a proxy keeps

  // Nothing queued: Ok without a descriptor. The worker's end closed: kAborted.
  CHECK(ReceiveSegment(pair[1], 0, &grant).ok());
  CHECK_EQ(grant.fd, -1);
  close(pair[0]);
  CHECK(ReceiveSegment(pair[1], 1000, &grant).code() == Code::kAborted);
  close(pair[1]);
}

TEST(TheHostSegmentIsOpenedThroughProcCheckedAndSharesDataBuffers) {
  const std::string token(kTokenBytes, 'k');
  HostSegment first;
  CHECK(!HostSegment::Create(1, token, &first).ok());  // one local rank: nothing to share
  Status st = HostSegment::Create(2, token, &first);
  CHECK(st.ok());
  if (!st.ok()) return;
  CHECK(FdTarget(first.fd()).rfind("/memfd:fasthorovod", 0) == 0);
  first.header()->worker_pid[0] = getpid();
  first.header()->worker_pid[1] = getpid();

  HostSegment second;  // as another local rank's worker would: through /proc/<pid>/fd/<fd>
  CHECK(HostSegment::Open(getpid(), first.fd(), 2, token, &second).ok());
  first.header()->posts[3][1].posted.store(7);
  CHECK_EQ(second.header()->posts[3][1].posted.load(), 7u);
  CHECK(second.fd() >= 0);  // kept, to be handed to the proxies

  HostSegment wrong;
  st = HostSegment::Open(getpid(), first.fd(), 2, std::string(kTokenBytes, 'x'), &wrong);
  CHECK(st.code() == Code::kInvalidArgument && st.message().find("another job") != std::string::npos);
  st = HostSegment::Open(getpid(), first.fd(), 3, token, &wrong);
  CHECK(st.code() == Code::kInvalidArgument && st.message().find("2 local ranks") != std::string::npos);
  st = HostSegment::Open(getpid(), 9999, 2, token, &wrong);
  CHECK(st.code() == Code::kIoError && st.message().find("/proc/") != std::string::npos);

  // Local rank 1 lists a data buffer (its descriptor open); another proxy maps it by id.
  ShmSegment data;
  CHECK(ShmSegment::Create(1 << 16, "a data buffer", &data).ok());
  CHECK(second.Publish(1, 5, data.fd(), data.size()).ok());
  ShmSegment mapped;
  CHECK(first.MapBuffer(1, 5, &mapped).ok());
  static_cast<char*>(data.data())[100] = 9;
  CHECK_EQ(static_cast<char*>(mapped.data())[100], 9);
  st = first.MapBuffer(1, 6, &mapped);
  CHECK(st.code() == Code::kInvalidArgument && st.message().find("never shared data buffer 6") != std::string::npos);
  CHECK(!second.Publish(2, 1, data.fd(), data.size()).ok());  // local rank out of range

  // The first failure on a host is kept, with the rank that raised it.
  RaiseHostAbort(first.header(), 3, Status::Error(Code::kTimeout, "first"));
  RaiseHostAbort(first.header(), 1, Status::Error(Code::kIoError, "second"));
  CHECK_EQ(second.header()->abort.load(), 1u);
  CHECK_EQ(second.header()->abort_rank, 3u);
  CHECK_EQ(std::string(second.header()->abort_reason), std::string("first"));
}

TEST(AShortageOfMemoryIsAnErrorNamingItNeverASignal) {
  std::string source;
  const uint64_t headroom = MemoryHeadroom(&source);
  CHECK(headroom > 0 && headroom < UINT64_MAX);
  CHECK(!source.empty());
  const uint64_t too_much = headroom + (uint64_t{64} << 30);  // nothing is allocated: checked first
  ShmSegment seg;
  Status st = ShmSegment::Create(too_much, "a test buffer", &seg);
  CHECK(!st.ok());
  CHECK(st.message().find("not enough memory for a test buffer: it needs " + HumanBytes(too_much)) !=
        std::string::npos);
  CHECK(st.message().find("raise the memory limit") != std::string::npos);
  CHECK(seg.data() == nullptr && seg.fd() == -1);
}

TEST(ASegmentSentToAProxyThatIsGoneIsNotAnError) {
  int pair[2];
  CHECK_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair), 0);
  close(pair[1]);
  ShmSegment seg;
  CHECK(ShmSegment::Create(4096, "a test buffer", &seg).ok());
  CHECK(SendSegment(pair[0], 1, 4096, seg.fd(), Deadline::After(1.0)).ok());  // no SIGPIPE either
  close(pair[0]);
}

TEST(ChildWatchReapsAtOnceAndKillsWhatOutlivesTheGracePeriod) {
  const int self = OpenPidfd(getpid());
  CHECK_EQ(ChildWatchSteps(self >= 0), 0);  // with pidfds wherever the kernel has them
  if (self >= 0) close(self);
}

TEST(ChildWatchWorksWithoutPidfds) {
  int helper = fork();
  if (helper == 0) _exit(testing::DenyPidfdOpen() ? ChildWatchSteps(false) : 100);
  int status = 0;
  waitpid(helper, &status, 0);
  CHECK(WIFEXITED(status));
  CHECK_EQ(WEXITSTATUS(status), 0);
}

// A "worker" spawns a "proxy" from a thread that then exits; the worker lives on for 300 ms and
// dies. The proxy's WorkerWatch must fire after the worker's death (not at the thread's exit) and
// within a second. Events arrive on a pipe: 's' proxy watching, 'w' worker about to die, 'd' seen.
void WorkerDeathSeenOnce(bool deny_pidfd) {
  int events[2];
  CHECK_EQ(pipe(events), 0);
  int worker = fork();
  if (worker == 0) {
    std::thread spawner([&] {
      if (fork() == 0) {
        if (deny_pidfd && !testing::DenyPidfdOpen()) _exit(1);
        static int out = events[1];
        WorkerWatch watch;
        Status st = watch.Start(getppid(), [] {
          (void)!write(out, "d", 1);
          _exit(0);
        });
        if (!st.ok() || watch.uses_pidfd() == deny_pidfd) _exit(2);
        (void)!write(events[1], "s", 1);
        sleep(10);
        _exit(3);
      }
    });
    spawner.join();  // the thread that spawned the proxy is gone
    usleep(300000);
    (void)!write(events[1], "w", 1);
    _exit(0);
  }
  close(events[1]);
  std::string seen;
  int64_t worker_died = 0;
  char c;
  while (seen.size() < 3) {
    pollfd p{events[0], POLLIN, 0};
    if (poll(&p, 1, 3000) <= 0 || read(events[0], &c, 1) != 1) break;
    seen += c;
    if (c == 'w') {
      waitpid(worker, nullptr, 0);
      worker_died = NowNs();
    }
  }
  CHECK_EQ(seen, std::string("swd"));
  CHECK(worker_died > 0 && Since(worker_died) < 1.0);
  close(events[0]);
  // The orphaned proxy is ours to reap (this process is a subreaper).
  Within(2.0, [] { return waitpid(-1, nullptr, WNOHANG) < 0 && errno == ECHILD; });
}

TEST(WorkerWatchSeesTheWorkerProcessDieNotTheThreadThatSpawned) {
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  WorkerDeathSeenOnce(false);
  WorkerDeathSeenOnce(true);
}
