// Python bindings of the tmrun native library.
#include <pybind11/pybind11.h>

#include "tmrun/nogil.h"

#include "tmrun/auth.h"
#include "tmrun/checksum.h"

namespace py = pybind11;

void bind_comm(py::module_& m);  // bind_comm.cpp: TCP communicator
void bind_nccl(py::module_& m);
void bind_peer_memory(py::module_& m);  // peer_memory.cpp: same-host reads of a peer's memory  // nccl_bind.cpp: NCCL transport (stub when built without nccl.h)

PYBIND11_MODULE(tmrun_native, m) {
  m.doc() = "tmrun native communicator and helpers";
  m.attr("__version__") = "0.1.0";
  tmrun::main_thread_ident = py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
  m.def(
      "crc32c",
      [](py::buffer data, uint32_t crc) {
        py::buffer_info info = data.request();
        if (info.ndim > 1 && !PyBuffer_IsContiguous(info.view(), 'C')) {
          throw py::value_error("crc32c needs a C-contiguous buffer");
        }
        const size_t nbytes = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
        tmrun::NoGil release;
        return tmrun::crc32c(crc, info.ptr, nbytes);
      },
      py::arg("data"), py::arg("crc") = 0u,
      "CRC-32C of a contiguous buffer (bytes, bytearray, memoryview, numpy array); "
      "pass a previous result as `crc` to extend it.");
  m.def(
      "crc32c_portable",
      [](py::bytes data, uint32_t crc) {
        const std::string_view view(data);
        return tmrun::crc32c_portable(crc, view.data(), view.size());
      },
      py::arg("data"), py::arg("crc") = 0u, "CRC-32C with lookup tables only (checks the CPU instruction's path).");
  m.attr("crc32c_hardware") = tmrun::crc32c_hardware();
  m.def(
      "sha256",
      [](py::bytes data) {
        const std::string_view v(data);
        auto d = tmrun::auth::sha256(v.data(), v.size());
        return py::bytes(reinterpret_cast<const char*>(d.data()), d.size());
      },
      py::arg("data"), "SHA-256 digest (the links' authentication uses it; exposed for tests).");
  m.def(
      "hmac_sha256",
      [](py::bytes key, py::bytes msg) {
        const std::string_view k(key), v(msg);
        auto d = tmrun::auth::hmac_sha256(k.data(), k.size(), v.data(), v.size());
        return py::bytes(reinterpret_cast<const char*>(d.data()), d.size());
      },
      py::arg("key"), py::arg("msg"), "HMAC-SHA256 (RFC 2104) of msg under key.");
  bind_comm(m);
  bind_nccl(m);
  bind_peer_memory(m);
}
