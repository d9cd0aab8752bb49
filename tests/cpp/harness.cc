#include "harness.h"

#include <chrono>
#include <cstring>
#include <mutex>

namespace fhtest {
namespace {
std::mutex g_mutex;
int g_failures = 0;
}  // namespace

std::vector<Case>& Registry() {
  static std::vector<Case> cases;
  return cases;
}

void Fail(const char* file, int line, const std::string& what) {
  std::lock_guard<std::mutex> lock(g_mutex);
  ++g_failures;
  std::fprintf(stderr, "  FAILED %s:%d: %s\n", file, line, what.c_str());
}

}  // namespace fhtest

int main(int argc, char** argv) {
  int failed_cases = 0, run = 0;
  for (const auto& c : fhtest::Registry()) {
    if (argc > 1 && std::strstr(c.name, argv[1]) == nullptr) continue;
    const int before = fhtest::g_failures;
    const auto start = std::chrono::steady_clock::now();
    c.body();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const bool ok = fhtest::g_failures == before;
    std::printf("%s %s (%.2f s)\n", ok ? "ok  " : "FAIL", c.name, s);
    std::fflush(stdout);
    ++run;
    if (!ok) ++failed_cases;
  }
  std::printf("%d tests, %d failed\n", run, failed_cases);
  return failed_cases == 0 && run > 0 ? 0 : 1;
}
