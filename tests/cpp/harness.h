// A tiny test harness for the C++ core (no framework is installed, none is vendored).
//
//   TEST(Name) { CHECK(cond); CHECK_EQ(a, b); }
//
// Every TEST registers itself; main() (harness.cc) runs them all, or those whose name contains
// argv[1], and exits non-zero if any check failed. A failed check reports and continues.
#pragma once

#include <cstdio>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace fhtest {

struct Case {
  const char* name;
  std::function<void()> body;
};

std::vector<Case>& Registry();
void Fail(const char* file, int line, const std::string& what);

struct Register {
  Register(const char* name, std::function<void()> body) { Registry().push_back({name, std::move(body)}); }
};

template <typename A, typename B>
std::string Pair(const A& a, const B& b) {
  std::ostringstream out;
  out << a << " vs " << b;
  return out.str();
}

}  // namespace fhtest

#define TEST(name)                                                  \
  static void name();                                               \
  static ::fhtest::Register register_##name(#name, name);           \
  static void name()

#define CHECK(cond) \
  ((cond) ? (void)0 : ::fhtest::Fail(__FILE__, __LINE__, "CHECK(" #cond ")"))

#define CHECK_EQ(a, b)                                                                              \
  (((a) == (b)) ? (void)0                                                                           \
                : ::fhtest::Fail(__FILE__, __LINE__, "CHECK_EQ(" #a ", " #b "): " + ::fhtest::Pair((a), (b))))
