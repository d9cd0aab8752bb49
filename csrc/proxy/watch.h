// Process lifetimes between a worker and its proxies, in both directions, on any Linux.
//
// ChildWatch (the worker's side) reaps each proxy the moment it exits, from a thread of its own,
// so a proxy that crashes never stays a zombie until shutdown, and remembers how it ended
// ("killed by signal 9"). It is told about exits by a pidfd per proxy (Linux >= 5.3); where
// pidfd_open is missing or forbidden (older kernels, some seccomp profiles) it polls waitpid every
// 50 ms instead. Terminate() gives the proxies a grace period to exit on their own, then kills the
// rest; either way every one is reaped before it returns.
//
// WorkerWatch (the proxy's side) notices the death of the worker *process*, whichever of its
// threads spawned the proxy (PR_SET_PDEATHSIG would fire when that thread exits, so hvd.init()
// from a short-lived thread would kill its proxies). It waits on a pidfd of the worker, or polls
// getppid() every 50 ms where pidfds are unavailable: a pid cannot be reused while it is still our
// parent, and once the worker is gone the kernel gives us another parent.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"

namespace fasthorovod {

// pidfd_open(pid), or -1 (errno set) where the kernel lacks it or a seccomp filter forbids it.
int OpenPidfd(int pid);

class ChildWatch {
 public:
  ChildWatch() = default;
  ~ChildWatch();  // kills and reaps any child still running (Terminate(0)), then stops the thread
  ChildWatch(const ChildWatch&) = delete;
  ChildWatch& operator=(const ChildWatch&) = delete;

  // Watches child `pid` (a process this one spawned and has not waited for) as `lane`.
  Status Add(uint32_t lane, int pid);
  bool Exited(uint32_t lane) const;
  // The lane of a child that has exited, waiting up to wait_ms for one; -1 if none. *how: "pid 12,
  // killed by signal 9 (Killed)", "pid 12, exited with status 1".
  int FirstExited(int wait_ms, std::string* how) const;
  // Exit code of `lane` in Python's Popen convention (-signal, or the exit status); false while it runs.
  bool ExitCode(uint32_t lane, int* code) const;
  // Waits until every child exited or grace_seconds passed, SIGKILLs the rest, and reaps them all.
  void Terminate(double grace_seconds);
  // Whether exits are seen through pidfds (false: the waitpid polling fallback).
  bool uses_pidfds() const;

 private:
  struct Child {
    uint32_t lane = 0;
    int pid = 0;
    int pidfd = -1;
    bool exited = false;
    int status = 0;  // waitpid's
  };
  void Run();
  void ReapLocked(Child& child);
  void Wake();

  mutable std::mutex mu_;
  mutable std::condition_variable exited_cv_;
  std::vector<Child> children_;
  bool stop_ = false;
  int wake_fd_ = -1;  // eventfd: a child was added, or stop
  std::thread thread_;
};

class WorkerWatch {
 public:
  WorkerWatch() = default;
  ~WorkerWatch();
  WorkerWatch(const WorkerWatch&) = delete;
  WorkerWatch& operator=(const WorkerWatch&) = delete;

  // Calls on_death once, from the watch's thread, when worker_pid (this process's parent) exits.
  // Fails if the worker is already gone.
  Status Start(int worker_pid, std::function<void()> on_death);
  bool uses_pidfd() const { return pidfd_ >= 0; }

 private:
  void Run();

  int worker_pid_ = 0;
  int pidfd_ = -1;
  int wake_fd_ = -1;
  std::function<void()> on_death_;
  std::thread thread_;
};

}  // namespace fasthorovod
