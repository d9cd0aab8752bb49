#include "bindings/errors.h"

#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace fasthorovod {

[[noreturn]] void Raise(const Status& st) {
  const char* cls = "FastHorovodError";
  switch (st.code()) {
    case Code::kTimeout: cls = "FastHorovodTimeoutError"; break;
    case Code::kMismatch: cls = "CollectiveMismatchError"; break;
    case Code::kInvalidArgument: throw py::value_error(st.message());
    default: break;
  }
  // A mismatch detected on another rank arrives as a peer error with the same text.
  if (st.code() == Code::kPeerError && st.message().find("collective mismatch") != std::string::npos) {
    cls = "CollectiveMismatchError";
  }
  py::object type = py::module_::import("fasthorovod.exceptions").attr(cls);
  PyErr_SetString(type.ptr(), st.message().c_str());
  throw py::error_already_set();
}


}  // namespace fasthorovod
