#include "shm/channel.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

namespace fasthorovod {

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int timeout_ms) {
  timespec ts{timeout_ms / 1000, static_cast<long>(timeout_ms % 1000) * 1000000L};
  // Not FUTEX_PRIVATE_FLAG: the word lives in memory shared between processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

void RaiseAbort(ChannelHeader* header, const Status& why) {
  uint32_t expected = 0;
  if (header->abort.load() == 0) {
    header->abort_code = static_cast<uint32_t>(why.ok() ? Code::kAborted : why.code());
    CopyString(header->abort_reason, why.message());
    header->abort.compare_exchange_strong(expected, 1, std::memory_order_release);
  }
}

}  // namespace fasthorovod
