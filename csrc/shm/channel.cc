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

bool RecordAbort(std::atomic<uint32_t>* flag, uint32_t* code, char (&reason)[kErrorBytes], const Status& why) {
  if (flag->load() != 0) return false;
  *code = static_cast<uint32_t>(why.ok() ? Code::kAborted : why.code());
  CopyString(reason, why.message());
  uint32_t expected = 0;
  flag->compare_exchange_strong(expected, 1, std::memory_order_release);
  return true;
}

void RaiseAbort(ChannelHeader* header, const Status& why) {
  RecordAbort(&header->abort, &header->abort_code, header->abort_reason, why);
}

}  // namespace fasthorovod
