#include "proxy/watch.h"

#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif

namespace fasthorovod {
namespace {

constexpr int kPollFallbackMs = 50;

std::string DescribeExit(int status) {
  if (WIFSIGNALED(status)) return Str("killed by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)), ")");
  if (WIFEXITED(status)) return Str("exited with status ", WEXITSTATUS(status));
  return "exited";
}

void Drain(int fd) {
  uint64_t n;
  (void)!::read(fd, &n, sizeof(n));
}

}  // namespace

int OpenPidfd(int pid) { return static_cast<int>(syscall(SYS_pidfd_open, pid, 0)); }

// -- ChildWatch ---------------------------------------------------------------------------------------

ChildWatch::~ChildWatch() {
  Terminate(0.0);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  Wake();
  if (thread_.joinable()) thread_.join();
  for (Child& c : children_) {
    if (c.pidfd >= 0) close(c.pidfd);
  }
  if (wake_fd_ >= 0) close(wake_fd_);
}

Status ChildWatch::Add(uint32_t lane, int pid) {
  std::lock_guard<std::mutex> lock(mu_);
  if (wake_fd_ < 0) {
    wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_fd_ < 0) return Status::Error(Code::kIoError, Str("eventfd(): ", ErrnoString(errno)));
    thread_ = std::thread([this] { Run(); });
  }
  Child c;
  c.lane = lane;
  c.pid = pid;
  c.pidfd = OpenPidfd(pid);  // -1: the polling fallback watches this child
  children_.push_back(c);
  Wake();
  return Status::Ok();
}

void ChildWatch::Wake() {
  if (wake_fd_ < 0) return;
  uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
}

// Under mu_: reaps `child` if it has exited. A child that someone else reaped (ECHILD) counts as
// exited with an unknown status.
void ChildWatch::ReapLocked(Child& child) {
  if (child.exited) return;
  int status = 0;
  pid_t r;
  do {
    r = waitpid(child.pid, &status, WNOHANG);
  } while (r < 0 && errno == EINTR);
  if (r == child.pid || (r < 0 && errno == ECHILD)) {
    child.exited = true;
    child.status = r == child.pid ? status : 0;
    exited_cv_.notify_all();
  }
}

void ChildWatch::Run() {
  std::vector<pollfd> fds;
  for (;;) {
    bool polling = false;
    fds.assign(1, pollfd{wake_fd_, POLLIN, 0});
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      for (const Child& c : children_) {
        if (c.exited) continue;
        if (c.pidfd >= 0) {
          fds.push_back({c.pidfd, POLLIN, 0});
        } else {
          polling = true;
        }
      }
    }
    int rc = poll(fds.data(), fds.size(), polling ? kPollFallbackMs : -1);
    if (rc > 0 && fds[0].revents != 0) Drain(wake_fd_);
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    for (Child& c : children_) ReapLocked(c);  // a readable pidfd means exited; waitpid is cheap
  }
}

bool ChildWatch::Exited(uint32_t lane) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Child& c : children_) {
    if (c.lane == lane) return c.exited;
  }
  return false;
}

int ChildWatch::FirstExited(int wait_ms, std::string* how) const {
  std::unique_lock<std::mutex> lock(mu_);
  auto first = [&]() -> const Child* {
    for (const Child& c : children_) {
      if (c.exited) return &c;
    }
    return nullptr;
  };
  const Child* c = first();
  if (c == nullptr && wait_ms > 0) {
    exited_cv_.wait_for(lock, std::chrono::milliseconds(wait_ms), [&] { return first() != nullptr; });
    c = first();
  }
  if (c == nullptr) return -1;
  if (how != nullptr) *how = Str("pid ", c->pid, ", ", DescribeExit(c->status));
  return static_cast<int>(c->lane);
}

bool ChildWatch::ExitCode(uint32_t lane, int* code) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Child& c : children_) {
    if (c.lane != lane || !c.exited) continue;
    *code = WIFSIGNALED(c.status) ? -WTERMSIG(c.status) : WIFEXITED(c.status) ? WEXITSTATUS(c.status) : 0;
    return true;
  }
  return false;
}

void ChildWatch::Terminate(double grace_seconds) {
  std::unique_lock<std::mutex> lock(mu_);
  auto all_exited = [&] {
    for (Child& c : children_) {
      ReapLocked(c);  // also works when the watch's thread is not running
      if (!c.exited) return false;
    }
    return true;
  };
  using Clock = std::chrono::steady_clock;
  const Clock::time_point until =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(grace_seconds));
  while (!all_exited() && Clock::now() < until) {
    // Slices of 10 ms: ReapLocked also runs here, so this works without the thread too.
    exited_cv_.wait_until(lock, std::min(until, Clock::now() + std::chrono::milliseconds(10)));
  }
  for (Child& c : children_) {
    if (c.exited) continue;
    // Not yet reaped, so the pid is still this child's (a pid is reused only after its reaping).
    if (c.pidfd < 0 || syscall(SYS_pidfd_send_signal, c.pidfd, SIGKILL, nullptr, 0) != 0) kill(c.pid, SIGKILL);
  }
  // SIGKILL ends even a stopped process at once; bound the wait anyway (a process in
  // uninterruptible sleep exits when its system call returns, and the thread reaps it then).
  const auto killed_until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!all_exited() && std::chrono::steady_clock::now() < killed_until) {
    exited_cv_.wait_for(lock, std::chrono::milliseconds(5));
  }
}

bool ChildWatch::uses_pidfds() const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Child& c : children_) {
    if (c.pidfd < 0) return false;
  }
  return true;
}

// -- WorkerWatch --------------------------------------------------------------------------------------

WorkerWatch::~WorkerWatch() {
  if (wake_fd_ >= 0) {
    uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof(one));
  }
  if (thread_.joinable()) thread_.join();
  if (pidfd_ >= 0) close(pidfd_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

Status WorkerWatch::Start(int worker_pid, std::function<void()> on_death) {
  worker_pid_ = worker_pid;
  on_death_ = std::move(on_death);
  pidfd_ = OpenPidfd(worker_pid);
  // Checked after opening the pidfd: if the worker is still our parent now, the pidfd is its.
  if (getppid() != worker_pid) {
    return Status::Error(Code::kAborted, "the worker exited before its proxy started");
  }
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) return Status::Error(Code::kIoError, Str("eventfd(): ", ErrnoString(errno)));
  thread_ = std::thread([this] { Run(); });
  return Status::Ok();
}

void WorkerWatch::Run() {
  for (;;) {
    pollfd fds[2] = {{wake_fd_, POLLIN, 0}, {pidfd_, POLLIN, 0}};
    const int n = pidfd_ >= 0 ? 2 : 1;
    int rc = poll(fds, n, pidfd_ >= 0 ? -1 : kPollFallbackMs);
    if (rc > 0 && fds[0].revents != 0) return;  // the watch is being destroyed
    const bool died = pidfd_ >= 0 ? (rc > 0 && fds[1].revents != 0) : getppid() != worker_pid_;
    if (died) {
      on_death_();
      return;
    }
  }
}

}  // namespace fasthorovod
