// For tests only (tests/cpp and the _C_testing module): makes pidfd_open fail with ENOSYS in this
// process and every process it starts from now on (a seccomp filter, inherited across fork and
// exec), as on Linux < 5.3 or under a seccomp profile that forbids it. Irreversible: call it in a
// child process. Returns false if the filter could not be installed (errno says why).
#pragma once

#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>

#include <cerrno>
#include <cstddef>

namespace fasthorovod {
namespace testing {

inline bool DenyPidfdOpen() {
  constexpr unsigned kPidfdOpen = 434;  // the same number on every architecture
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kPidfdOpen, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (ENOSYS & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return false;
  return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0;
}

}  // namespace testing
}  // namespace fasthorovod
