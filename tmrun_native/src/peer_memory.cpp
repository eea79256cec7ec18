// Reading a peer process's memory on the same host (Linux cross-memory attach,
// process_vm_readv): one copy, kernel to kernel, instead of a socket's two copies and its
// protocol. A migration's joiner uses it to take the leaver's state when both run on one
// host, the way MPI libraries move large intra-node messages (CMA).
#include <pybind11/pybind11.h>

#include "tmrun/nogil.h"
#include <pybind11/stl.h>

#include <cerrno>
#include <cstdint>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/prctl.h>
#include <sys/uio.h>
#endif

namespace py = pybind11;

namespace {

struct Span {
  uintptr_t remote;
  char* local;
  size_t length;
};

constexpr size_t kChunk = size_t{256} << 20;  // bytes per system call

// Reads every span; returns 0, or the errno of the first failure (GIL not needed).
int read_spans(pid_t pid, const std::vector<Span>& spans, size_t& done) {
#if defined(__linux__)
  for (const Span& span : spans) {
    size_t offset = 0;
    while (offset < span.length) {
      const size_t want = std::min(kChunk, span.length - offset);
      iovec local{span.local + offset, want};
      iovec remote{reinterpret_cast<void*>(span.remote + offset), want};
      const ssize_t got = process_vm_readv(pid, &local, 1, &remote, 1, 0);
      if (got < 0) {
        if (errno == EINTR) continue;
        return errno;
      }
      if (got == 0) return EFAULT;  // nothing readable there any more
      offset += static_cast<size_t>(got);
      done += static_cast<size_t>(got);
    }
  }
  return 0;
#else
  (void)pid;
  (void)spans;
  (void)done;
  return ENOSYS;
#endif
}

}  // namespace

void bind_peer_memory(py::module_& m) {
  m.def(
      "read_peer_memory",
      [](int pid, const std::vector<uintptr_t>& addresses, const py::list& buffers) {
        if (addresses.size() != buffers.size()) {
          throw py::value_error("read_peer_memory: " + std::to_string(addresses.size()) + " addresses for " +
                                std::to_string(buffers.size()) + " buffers");
        }
        if (pid <= 0) throw py::value_error("read_peer_memory: pid must be positive");
        std::vector<Span> spans;
        std::vector<py::buffer_info> views;  // holds the buffers' exports while reading
        views.reserve(buffers.size());
        for (size_t i = 0; i < buffers.size(); ++i) {
          views.push_back(py::reinterpret_borrow<py::buffer>(buffers[i]).request(true));
          const py::buffer_info& info = views.back();
          if (info.ndim > 1 && !PyBuffer_IsContiguous(info.view(), 'C')) {
            throw py::value_error("read_peer_memory needs C-contiguous buffers");
          }
          const size_t length = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
          spans.push_back(Span{addresses[i], static_cast<char*>(info.ptr), length});
        }
        size_t done = 0;
        int error = 0;
        {
          tmrun::NoGil release;
          error = read_spans(static_cast<pid_t>(pid), spans, done);
        }
        if (error != 0) {
          errno = error;
          PyErr_SetFromErrno(PyExc_OSError);
          throw py::error_already_set();
        }
        return done;
      },
      py::arg("pid"), py::arg("addresses"), py::arg("buffers"),
      "Copy, from process `pid` on this host, the bytes at each of `addresses` into the buffer of the same "
      "index (as many bytes as it holds). Returns the bytes copied; raises OSError (EPERM: not allowed, "
      "ESRCH: no such process, EFAULT: not mapped there, ENOSYS: not Linux).");
  m.def(
      "allow_peer_reader",
      [](int pid) {
#if defined(__linux__) && defined(PR_SET_PTRACER)
        // Under Yama's ptrace_scope 1 only a process's ancestors may read it; this names one more.
        // Without Yama the call fails with EINVAL and nothing is needed: same user suffices.
        return prctl(PR_SET_PTRACER, static_cast<unsigned long>(pid), 0, 0, 0) == 0;
#else
        (void)pid;
        return false;
#endif
      },
      py::arg("pid"),
      "Let process `pid` read this one's memory where Yama restricts it to ancestors; False if not applicable.");
}
