// The binding edge's one error path: a failed Status becomes the Python exception of its kind.
//
// The class is chosen from the Status's Code alone, never from its message, by one table in
// Python (fasthorovod.exceptions.error_for): timeout → FastHorovodTimeoutError, mismatch →
// CollectiveMismatchError, invalid argument → FastHorovodValueError (a ValueError too), a dead
// proxy → ProxyDiedError, everything else → FastHorovodError (a HorovodInternalError).
#pragma once

#include <pybind11/pybind11.h>

#include <string>
#include <utility>

#include "common/status.h"

namespace fasthorovod {

[[noreturn]] inline void RaiseStatus(const Status& st) {
  namespace py = pybind11;
  py::object error = py::module_::import("fasthorovod.exceptions")
                         .attr("error_for")(CodeName(st.ok() ? Code::kPeerError : st.code()), st.message());
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
  throw py::error_already_set();
}

inline void Check(const Status& st) {
  if (!st.ok()) RaiseStatus(st);
}

// For argument checks in the bindings themselves.
[[noreturn]] inline void ThrowInvalidArgument(std::string message) {
  RaiseStatus(Status::Error(Code::kInvalidArgument, std::move(message)));
}

// Runs a blocking call without the GIL (so other Python threads, e.g. Horovod's, keep running),
// then raises its error, if any.
template <typename F>
void CallReleased(F&& call) {
  Status st;
  {
    pybind11::gil_scoped_release release;
    st = call();
  }
  Check(st);
}

// Runs work that cannot fail, without the GIL when `release` (large inputs: other Python threads
// keep running meanwhile), else holding it (small inputs: releasing costs more than the work).
template <typename F>
void RunReleasedIf(bool release, F&& run) {
  if (release) {
    pybind11::gil_scoped_release unlocked;
    run();
  } else {
    run();
  }
}

}  // namespace fasthorovod
