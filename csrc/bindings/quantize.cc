// fasthorovod._C: the 2-bit quantizer (csrc/collectives/quantize.h) on Python buffers.
//
// Buffers are anything with the buffer protocol (numpy arrays; torch CPU tensors through
// `.numpy()`), C-contiguous. Gradients and residuals are float32; packed payloads are any 4-byte
// element type (int32 tensors carry them through Horovod's allgather). Large inputs run with the
// GIL released.
#include <pybind11/pybind11.h>

#include <string>

#include "bindings/errors.h"
#include "collectives/quantize.h"

namespace py = pybind11;
using namespace fasthorovod;

namespace {

// Below this many elements the work is shorter than releasing and retaking the GIL.
constexpr size_t kReleaseGilElements = 1 << 15;

bool CContiguous(const py::buffer_info& info) {
  py::ssize_t expected = info.itemsize;
  for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[d] != 1 && info.strides[d] != expected) return false;
    expected *= info.shape[d];
  }
  return true;
}

py::buffer_info Request(py::buffer& b, bool writable, const char* what) {
  py::buffer_info info = b.request(writable);
  if (!CContiguous(info)) ThrowInvalidArgument(std::string(what) + " must be C-contiguous");
  return info;
}

py::buffer_info Float32(py::buffer& b, bool writable, const char* what) {
  py::buffer_info info = Request(b, writable, what);
  if (info.itemsize != 4 || info.format != py::format_descriptor<float>::format()) {
    ThrowInvalidArgument(std::string(what) + " must be float32, got format '" + info.format + "'");
  }
  return info;
}

py::buffer_info Words(py::buffer& b, bool writable, const char* what) {
  py::buffer_info info = Request(b, writable, what);
  if (info.itemsize != 4) {
    ThrowInvalidArgument(std::string(what) + " must have 4-byte elements (int32/uint32), got " +
                          std::to_string(info.itemsize) + "-byte '" + info.format + "'");
  }
  return info;
}

void CheckThreshold(float threshold) {
  if (!(threshold > 0.0f)) ThrowInvalidArgument("threshold must be > 0, got " + std::to_string(threshold));
}

void Quantize(py::buffer grad, py::buffer residual, py::buffer packed, float threshold) {
  CheckThreshold(threshold);
  py::buffer_info g = Float32(grad, false, "grad");
  py::buffer_info r = Float32(residual, true, "residual");
  py::buffer_info q = Words(packed, true, "packed");
  const size_t count = static_cast<size_t>(g.size);
  if (static_cast<size_t>(r.size) != count) {
    ThrowInvalidArgument("residual has " + std::to_string(r.size) + " elements, grad " + std::to_string(count));
  }
  if (static_cast<size_t>(q.size) != PackedWords2Bit(count)) {
    ThrowInvalidArgument("packed must hold exactly " + std::to_string(PackedWords2Bit(count)) + " words for " +
                          std::to_string(count) + " values, got " + std::to_string(q.size));
  }
  auto run = [&] {
    Quantize2Bit(static_cast<const float*>(g.ptr), static_cast<float*>(r.ptr), count, threshold,
                 static_cast<uint32_t*>(q.ptr));
  };
  RunReleasedIf(count >= kReleaseGilElements, run);
}

void DequantizeSum(py::buffer payloads, py::buffer out, float threshold, float scale) {
  CheckThreshold(threshold);
  py::buffer_info p = Words(payloads, false, "payloads");
  py::buffer_info o = Float32(out, true, "out");
  const size_t count = static_cast<size_t>(o.size);
  if (p.ndim != 1 && p.ndim != 2) ThrowInvalidArgument("payloads must be 1-D (one payload) or 2-D (one per row)");
  const size_t num_payloads = p.ndim == 2 ? static_cast<size_t>(p.shape[0]) : 1;
  const size_t words_per_payload = p.ndim == 2 ? static_cast<size_t>(p.shape[1]) : static_cast<size_t>(p.size);
  if (words_per_payload != PackedWords2Bit(count)) {
    ThrowInvalidArgument("each payload must hold " + std::to_string(PackedWords2Bit(count)) + " words for " +
                          std::to_string(count) + " values, got " + std::to_string(words_per_payload));
  }
  auto run = [&] {
    DequantizeSum2Bit(static_cast<const uint32_t*>(p.ptr), num_payloads, words_per_payload, count, threshold, scale,
                      static_cast<float*>(o.ptr));
  };
  RunReleasedIf(count * (num_payloads ? num_payloads : 1) >= kReleaseGilElements, run);
}

}  // namespace

void RegisterQuantize(py::module_& m) {
  m.def("quantize_2bit", &Quantize, py::arg("grad"), py::arg("residual"), py::arg("packed"),
        py::arg("threshold") = 0.5f,
        R"pbdoc(2-bit quantization with error feedback (MXNet's rule), in place.

For each element: r += g; r >= t sends +t (r -= t), r <= -t sends -t (r += t), else 0. Writes
ceil(n/16) words to `packed` (16 values per word, MXNet's bit layout) and updates `residual`.
`grad` and `residual` are float32 buffers of n elements; `packed` has 4-byte elements.)pbdoc");
  m.def("dequantize_sum_2bit", &DequantizeSum, py::arg("payloads"), py::arg("out"), py::arg("threshold") = 0.5f,
        py::arg("scale") = 1.0f,
        R"pbdoc(out = scale * (sum of the dequantized payloads), overwriting `out` (float32, n elements).

`payloads` is one packed payload (1-D, ceil(n/16) words) or one per row (2-D), e.g. an allgather
result. Per element the result is (#+t - #-t) * (threshold * scale): independent of row order.)pbdoc");
  m.def("packed_words_2bit", &PackedWords2Bit, py::arg("count"),
        R"pbdoc(Number of 32-bit words that hold `count` 2-bit values.)pbdoc");
}
